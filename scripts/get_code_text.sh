#!/usr/bin/env bash
# A reproducible source-code text for the KV-policy comparison: the Rust sources of one pinned
# crate from crates.io, serde_json 1.0.154 (the version in this repository's Cargo.lock), as
# one file.
#
#   scripts/get_code_text.sh [OUT_DIR]      (default OUT_DIR: <repo>/data/texts)
#
# Writes OUT_DIR/rust_serde_json.txt: every `src/**/*.rs` of the crate in byte-wise sorted path
# order (LC_ALL=C), each preceded by a line `// ==== <path> ====` and followed by a blank line.
# The .crate archive comes from cargo's registry cache (`cargo fetch` fills it; any cargo
# project that locks serde_json 1.0.154 does), else from static.crates.io, and its sha256 is
# checked against the checksum in Cargo.lock before it is unpacked.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo/data/texts}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
name=serde_json
ver=1.0.154
sum="$(awk -v n="$name" -v v="$ver" '
  $0 == "name = \"" n "\"" { hit = 1; next }
  hit && $0 == "version = \"" v "\"" { ok = 1; next }
  ok && /^checksum = / { gsub(/"/, "", $3); print $3; exit }
  /^\[\[package\]\]/ { hit = 0; ok = 0 }' "$repo/Cargo.lock")"
[ -n "$sum" ] || { echo "$name $ver is not in Cargo.lock" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
crate="$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$name-$ver.crate" 2>/dev/null | head -1 || true)"
if [ -z "$crate" ]; then
    crate="$work/$name-$ver.crate"
    curl -fsSL "https://static.crates.io/crates/$name/$name-$ver.crate" -o "$crate"
fi
echo "$sum  $crate" | sha256sum -c - >&2
tar -xzf "$crate" -C "$work"
(
    cd "$work/$name-$ver"
    find src -name '*.rs' | LC_ALL=C sort | while read -r f; do
        printf '// ==== %s ====\n' "$f"
        cat "$f"
        printf '\n'
    done
) > "$out/rust_serde_json.txt"
sha256sum "$out/rust_serde_json.txt"
wc -c "$out/rust_serde_json.txt" >&2
