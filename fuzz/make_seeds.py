#!/usr/bin/env python3
"""Seed corpora for the slowfast fuzz targets, generated at fuzz time (not committed):
repository fixtures plus, when present, a shrunk copy of the default model's GGUF header.

usage: make_seeds.py REPO_ROOT OUT_DIR [MODEL.gguf]
Writes OUT_DIR/<target>/<name> files; the committed hand seeds in fuzz/seeds/ are copied too.
"""
import glob, os, shutil, struct, sys

repo, out = sys.argv[1], sys.argv[2]
model = sys.argv[3] if len(sys.argv) > 3 and os.path.isfile(sys.argv[3]) else None
fx = os.path.join(repo, "tests/fixtures")


def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def read(p):
    with open(p, "rb") as f:
        return f.read()


# committed hand-written seeds
for d in glob.glob(os.path.join(repo, "fuzz/seeds/*")):
    for p in glob.glob(os.path.join(d, "*")):
        put(os.path.basename(d), os.path.basename(p), read(p))


class R:
    def __init__(s, b):
        s.b, s.p = b, 0

    def take(s, n):
        v = s.b[s.p:s.p + n]
        s.p += n
        return v

    def u32(s):
        return struct.unpack("<I", s.take(4))[0]

    def u64(s):
        return struct.unpack("<Q", s.take(8))[0]

    def string(s):
        return s.take(s.u64())


SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def value(r, ty, w, keep):
    """Copy one metadata value from r to w (list of bytes), arrays cut to `keep` elements."""
    if ty in SIZES:
        w.append(r.take(SIZES[ty]))
    elif ty == 8:
        s = r.string()
        w.append(struct.pack("<Q", len(s)) + s)
    elif ty == 9:
        et, n = r.u32(), r.u64()
        k = min(n, keep)
        w.append(struct.pack("<IQ", et, k))
        for i in range(n):
            sub = []
            value(r, et, sub, keep)
            if i < k:
                w.extend(sub)
    else:
        raise ValueError(ty)


def shrink_gguf(b, keep=256, max_tensor=4096):
    """A valid GGUF with the same metadata keys (arrays cut to `keep` elements) and the
    small tensors of `b`, their data zeroed."""
    r = R(b)
    assert r.take(4) == b"GGUF"
    ver, nt, nkv = r.u32(), r.u64(), r.u64()
    kv = []
    align = 32
    for _ in range(nkv):
        k = r.string()
        ty = r.u32()
        w = []
        value(r, ty, w, keep)
        kv.append(struct.pack("<Q", len(k)) + k + struct.pack("<I", ty) + b"".join(w))
    ts = []
    for _ in range(nt):
        name = r.string()
        nd = r.u32()
        dims = [r.u64() for _ in range(nd)]
        ty = r.u32()
        r.u64()
        ts.append((name, dims, ty))
    layout = {0: (1, 4), 1: (1, 2), 8: (32, 34), 12: (256, 144), 14: (256, 210), 30: (1, 2)}
    small = []
    for name, dims, ty in ts:
        if ty not in layout:
            continue
        n = 1
        for d in dims:
            n *= d
        bs, tsz = layout[ty]
        size = n // bs * tsz
        if size <= max_tensor:
            small.append((name, dims, ty, size))
    small = small[:16]
    head = b"GGUF" + struct.pack("<IQQ", ver, len(small), len(kv)) + b"".join(kv)
    off = 0
    data = b""
    for name, dims, ty, size in small:
        head += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
        head += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ty, off)
        pad = (-size) % align
        data += b"\0" * (size + pad)
        off += size + pad
    head += b"\0" * ((-len(head)) % align)
    return head + data


for p in sorted(glob.glob(os.path.join(fx, "gguf/*.gguf"))):
    b = read(p)
    name = os.path.basename(p)
    if len(b) <= 256 << 10:
        put("gguf", name, b)
    try:
        put("gguf", "shrunk-" + name, shrink_gguf(b))
    except Exception as e:  # a fixture this script cannot shrink: keep the raw one
        print(f"make_seeds: {name}: {e}", file=sys.stderr)
if model:
    with open(model, "rb") as f:
        head = f.read(16 << 20)  # the header of the 270M model is well within 16 MiB
    try:
        put("gguf", "default-model-shrunk.gguf", shrink_gguf(head, keep=512))
    except Exception as e:
        print(f"make_seeds: default model: {e}", file=sys.stderr)
    put("gguf", "default-model-first-64k.gguf", head[:64 << 10])

# safetensors: selector byte 0 = shard header, 1 = index
for p in sorted(glob.glob(os.path.join(fx, "hf/*/*.safetensors"))):
    b = read(p)
    (hl,) = struct.unpack("<Q", b[:8])
    tag = p.split("/")[-2] + "-" + os.path.basename(p)
    if len(b) <= 64 << 10:
        put("safetensors", tag, b"\0" + b)
    # the header and a zero-filled data section of the right size
    put("safetensors", "hdr-" + tag, b"\0" + b[: 8 + hl] + b"\0" * min(len(b) - 8 - hl, 4096))
for p in sorted(glob.glob(os.path.join(fx, "hf/*/model.safetensors.index.json"))):
    put("safetensors", p.split("/")[-2] + "-index.json", b"\1" + read(p))

# hf_config: selector 0 = config.json, 1 = tokenizer.json, 2 = tokenizer_config.json
for sel, name in [(0, "config.json"), (1, "tokenizer.json"), (2, "tokenizer_config.json"),
                  (0, "generation_config.json")]:
    for p in sorted(glob.glob(os.path.join(fx, "hf/*/" + name))):
        put("hf_config", p.split("/")[-2] + "-" + name, bytes([sel]) + read(p))

# chat_template, tokenizer, http_body, cli_parsers: the committed hand seeds above, plus text
texts = [read(p)[:2048] for p in sorted(glob.glob(os.path.join(fx, "gemma3/*.json")))[:2]]
for i, t in enumerate(texts):
    for sel in (0x00, 0x01, 0x02, 0x03, 0x50, 0x21, 0xa0):
        put("tokenizer", f"fixture{i}-{sel:02x}", bytes([sel]) + t)
