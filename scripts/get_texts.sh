#!/usr/bin/env bash
# Fetch long public-domain English texts from Debian packages into data/texts/ (git-ignored).
#
#   scripts/get_texts.sh [OUT_DIR]        (default OUT_DIR: <repo>/data/texts)
#
# Packages are fetched with `apt-get download` and unpacked with `dpkg -x` into a temp dir, so
# nothing is installed system-wide and no root is needed (except for `apt-get update` when the
# package lists are missing).
#   - bible-kjv-text + bible-kjv: King James Bible, dumped by the package's own `bible` program
#     -> kjv_bible.txt (chapter headings "Genesis 1", then one verse per line "1 In the ...").
#   - r-cran-janeaustenr: Jane Austen's six novels, read from the R lazy-load DB by
#     scripts/fixtures/austen_rdb.py (no R needed) -> austen_<novel>.txt (original line breaks).
# Writes OUT_DIR/SHA256SUMS. Gemma 3 token counts (llama.cpp, with BOS): emma 213937,
# mansfieldpark 209194, northangerabbey 101880, persuasion 111589, prideprejudice 161112,
# sensesensibility 160684, kjv_bible 1058324 -- all far above 16K.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo/data/texts}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

pkgs=(bible-kjv-text bible-kjv r-cran-janeaustenr)
cd "$work"
if ! apt-get download "${pkgs[@]}" >/dev/null 2>&1; then
    echo "apt-get download failed; running apt-get update and retrying" >&2
    if [ "$(id -u)" -eq 0 ]; then apt-get update -qq; else sudo apt-get update -qq; fi
    apt-get download "${pkgs[@]}"
fi
for deb in ./*.deb; do dpkg -x "$deb" root; done

# King James Bible. -l sets the line width: large, so each verse stays on one line.
root/usr/bin/bible -p root/usr/lib -l1000000 "Gen1:1-Rev22:21" \
    | sed -e 's/^ *//' | sed -e '1{/^$/d}' > "$out/kjv_bible.txt"

# Jane Austen.
python3 "$repo/scripts/fixtures/austen_rdb.py" \
    root/usr/lib/R/site-library/janeaustenr/data "$out" >&2

cd "$out"
sha256sum ./*.txt | sed 's# \./# #' > SHA256SUMS
ls -l "$out"
