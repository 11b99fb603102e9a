"""A tiny PTX interpreter: checks a rendered kernel's numbers on a machine without a GPU.

One block at a time; each thread runs until its next bar.sync, then the next thread (the
kernels it is used on have no warp-synchronous code). It knows the instructions of
flash_attention.ptx, gdn_chunk.ptx and kquant_gemm.ptx (tests/ops/test_ptxsim.py) and raises on
any other, and on
misaligned or out-of-bounds memory accesses. fp32 as on the GPU: FMAs rounded once, ex2 and rcp
exact (the GPU's approximations are within their tests' tolerances). Shared memory starts
poisoned (0x7F7F7F7F, a huge float) so a read before a write shows. Slow: ~10 us an instruction.
"""
import re, struct, numpy as np

F32 = np.float32

def f32_imm(tok):
    return struct.unpack("<f", struct.pack("<I", int(tok[2:], 16)))[0]

class Kernel:
    def __init__(self, text, entry):
        m = re.search(r"\.entry\s+" + entry + r"\s*\((.*?)\)", text, re.S)
        self.params = [p.split()[-1] for p in m.group(1).split(",")]
        self.ptypes = [p.split()[1] for p in m.group(1).split(",")]
        body = text[text.index("{", m.end()) + 1:]
        # the entry's body ends at the matching closing brace at column 0
        body = body[:body.index("\n}")]
        self.shared, self.local = {}, {}
        sh_off, lo_off = 0, 0
        self.ins, self.labels = [], {}
        pending = ""
        for raw in body.split("\n"):
            line = raw.split("//")[0].strip()
            if not line:
                continue
            if pending or (not line.endswith(";") and not line.endswith(":")):
                pending += " " + line
                if not line.endswith(";"):
                    continue
                line, pending = pending.strip(), ""
            if line.endswith(":"):
                self.labels[line[:-1]] = len(self.ins)
                continue
            if line.startswith(".reg"):
                continue
            md = re.match(r"\.(shared|local)\s+\.align\s+(\d+)\s+\.(\w+)\s+(\w+)\[(\d+)\];", line)
            if md:
                space, align, ty, name, n = md.groups()
                size = int(n) * (1 if ty == "b8" else 4)
                if space == "shared":
                    sh_off = -(-sh_off // int(align)) * int(align)
                    self.shared[name] = sh_off; sh_off += size
                else:
                    lo_off = -(-lo_off // int(align)) * int(align)
                    self.local[name] = lo_off; lo_off += size
                continue
            self.ins.append(line.rstrip(";"))
        self.shared_size, self.local_size = sh_off + 16, lo_off + 16
        self.decoded = [self.decode(s) for s in self.ins]

    def decode(self, s):
        pred = None
        if s.startswith("@"):
            p, s = s.split(None, 1)
            pred = (p[1] == "!", p[1:].lstrip("!"))
        op, _, rest = s.partition(" ")
        # split operands at commas outside braces/brackets
        ops, depth, cur = [], 0, ""
        for ch in rest:
            if ch in "{[": depth += 1
            if ch in "}]": depth -= 1
            if ch == "," and depth == 0:
                ops.append(cur.strip()); cur = ""
            else:
                cur += ch
        if cur.strip(): ops.append(cur.strip())
        return pred, op.split("."), ops

LOCAL_BASE = 1 << 44

class Sim:
    def __init__(self, kernel, args, gmem, grid, block):
        self.k, self.args, self.g, self.grid, self.block = kernel, args, gmem, grid, block

    def run_block(self, cx, cy):
        k = self.k
        shared = np.zeros(k.shared_size, np.uint8)
        shared[:] = 0x7F  # poison: NaN-ish floats
        n = self.block
        regs = [dict() for _ in range(n)]
        locs = [np.zeros(k.local_size, np.uint8) for _ in range(n)]
        pcs = [0] * n
        done = [False] * n
        while not all(done):
            for t in range(n):
                if done[t]: continue
                pcs[t], fin = self.run_thread(t, regs[t], locs[t], shared, pcs[t], cx, cy)
                done[t] = fin
            # all reached barrier or finished

    def val(self, tok, R, t, cx, cy, ty):
        if tok.startswith("%"):
            sp = {"%tid.x": t, "%ctaid.x": cx, "%ctaid.y": cy, "%nctaid.x": self.grid[0],
                  "%nctaid.y": self.grid[1], "%ntid.x": self.block}
            if tok in sp: return sp[tok]
            return R[tok]
        if tok.startswith("0f"): return f32_imm(tok)
        if tok in self.k.shared: return self.k.shared[tok]
        if tok in self.k.local: return self.k.local[tok]
        if tok.startswith("0x") or tok.startswith("0X"): return int(tok, 16)
        if ty and ty[0] == "f": return float(tok)
        return int(tok)

    def addr(self, tok, R):
        inner = tok.strip("[]")
        m = re.match(r"([%\w]+)\s*(?:\+\s*(-?\d+))?$", inner)
        base, off = m.group(1), int(m.group(2) or 0)
        if base.startswith("%"): b = R[base]
        elif base in self.k.shared: b = self.k.shared[base]
        elif base in self.k.local: b = self.k.local[base]
        else: b = self.args[base]
        return b + off

    def mem(self, space, a, nbytes, loc, shared):
        if space == "shared": return shared, a
        if space == "local": return loc, a
        if space == "param": raise RuntimeError
        if space == "generic":
            if a >= LOCAL_BASE: return loc, a - LOCAL_BASE
            return self.g, a
        return self.g, a

    def run_thread(self, t, R, loc, shared, pc, cx, cy):
        k = self.k
        ins = k.decoded
        while True:
            pred, op, ops = ins[pc]
            pc += 1
            if pred is not None:
                neg, p = pred
                if bool(R[p]) == neg:
                    continue
            name = op[0]
            ty = op[-1] if len(op) > 1 else ""
            if name == "ret":
                return pc, True
            if name == "bar":
                return pc, False
            if name == "bra":
                pc = k.labels[ops[0]]; continue
            if name == "red" and op[2:] == ["add", "f32"]:  # red.global.add.f32 [a], v
                a = self.addr(ops[0], R)
                if a % 4 or a < 0 or a + 4 > len(self.g):
                    raise RuntimeError(f"bad address {k.ins[pc-1]} at {a}")
                view = self.g[a:a + 4].view(F32)
                view[0] = F32(view[0]) + F32(self.val(ops[1], R, t, cx, cy, "f32"))
                continue
            if name in ("ld", "st"):
                space = op[1] if op[1] in ("shared", "global", "param", "local") else "generic"
                vec = next((int(o[1:]) for o in op if o in ("v2", "v4")), 1)
                dty = op[-1]
                size = int(re.sub(r"\D", "", dty))
                npty = {"f32": F32, "u32": np.uint32, "b32": np.uint32, "u64": np.uint64,
                        "s32": np.int32, "u16": np.uint16, "b16": np.uint16, "u8": np.uint8,
                        "s8": np.int8}[dty]
                if name == "ld" and space == "param":
                    i = k.params.index(ops[1].strip("[]"))
                    R[ops[0]] = self.args["__param__"][i]; continue
                memop = ops[1] if name == "ld" else ops[0]
                a = self.addr(memop, R)
                buf, off = self.mem(space, a, size // 8 * vec, loc, shared)
                regs = ops[0] if name == "ld" else ops[1]
                regs = [r.strip() for r in regs.strip("{}").split(",")]
                if off % (size // 8 * vec): raise RuntimeError(f"misaligned {ins[pc-1]} {off}")
                if off < 0 or off + size // 8 * vec > len(buf):
                    raise RuntimeError(f"out of bounds {k.ins[pc-1]} at {off} (len {len(buf)})")
                view = buf[off:off + size // 8 * vec].view(npty)
                if name == "ld":
                    for i, r in enumerate(regs):
                        v = view[i]
                        R[r] = float(v) if dty == "f32" else int(v)
                else:
                    for i, r in enumerate(regs):
                        v = self.val(r, R, t, cx, cy, dty)
                        view[i] = v
                continue
            d = ops[0]
            if name == "setp":
                cmp = op[1]; a = self.val(ops[1], R, t, cx, cy, ty); b = self.val(ops[2], R, t, cx, cy, ty)
                R[d] = {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[cmp]
                continue
            if name == "selp":
                R[d] = self.val(ops[1], R, t, cx, cy, ty) if R[ops[3]] else self.val(ops[2], R, t, cx, cy, ty)
                continue
            if name == "cvta":
                v = self.val(ops[1], R, t, cx, cy, "u64")
                if "local" in op: v += LOCAL_BASE
                R[d] = v; continue
            a = [self.val(o, R, t, cx, cy, ty) for o in ops[1:]]
            if name == "cvt" and ty != "f32":      # from an integer or f16: dst is op[-2]
                v, dst, sb = a[0], op[-2], int(re.sub(r"\D", "", ty))
                if ty == "f16":
                    v = float(np.array(v & 0xFFFF, np.uint16).view(np.float16))
                else:
                    v &= (1 << sb) - 1
                    if ty[0] == "s" and v >> (sb - 1):
                        v -= 1 << sb
                if dst == "f32":
                    R[d] = float(F32(v))
                else:
                    R[d] = v & ((1 << int(re.sub(r"\D", "", dst))) - 1)
                continue
            if name == "bfe":                         # bfe.{u,s}32 d, a, pos, len
                v = (a[0] & 0xFFFFFFFF) >> a[1] & ((1 << a[2]) - 1)
                if ty == "s32" and a[2] and v >> (a[2] - 1):
                    v -= 1 << a[2]
                R[d] = v & 0xFFFFFFFF
                continue
            if name == "bfi":                         # bfi.b32 d, f, b, pos, len
                m = ((1 << a[3]) - 1) << a[2]
                R[d] = ((a[1] & ~m) | ((a[0] << a[2]) & m)) & 0xFFFFFFFF
                continue
            if ty == "f32":
                f = lambda x: float(F32(x))
                if name == "mov": R[d] = f(a[0])
                elif name == "add": R[d] = f(F32(a[0]) + F32(a[1]))
                elif name == "sub": R[d] = f(F32(a[0]) - F32(a[1]))
                elif name == "mul": R[d] = f(F32(a[0]) * F32(a[1]))
                elif name in ("fma", "mad"): R[d] = f(np.float64(a[0]) * np.float64(a[1]) + np.float64(a[2]))
                elif name == "max": R[d] = max(a[0], a[1]) if not (np.isnan(a[0]) or np.isnan(a[1])) else (a[1] if np.isnan(a[0]) else a[0])
                elif name == "min": R[d] = min(a[0], a[1])
                elif name == "neg": R[d] = -a[0]
                elif name == "ex2":
                    with np.errstate(over="ignore"): R[d] = f(np.exp2(np.float64(a[0])))
                elif name == "rcp":
                    with np.errstate(divide="ignore"): R[d] = f(np.float64(1) / np.float64(a[0]))
                elif name == "div":
                    with np.errstate(divide="ignore", invalid="ignore"): R[d] = f(F32(a[0]) / F32(a[1]))
                else: raise RuntimeError(f"op {op}")
                continue
            bits = 64 if ty.endswith("64") else 32
            mask = (1 << bits) - 1
            if name == "mov": R[d] = a[0] & mask if isinstance(a[0], int) else a[0]
            elif name == "add": R[d] = (a[0] + a[1]) & mask
            elif name == "sub": R[d] = (a[0] - a[1]) & mask
            elif name == "mul":
                if "wide" in op: R[d] = (a[0] * a[1]) & ((1 << 64) - 1)
                else: R[d] = (a[0] * a[1]) & mask
            elif name == "mad": R[d] = (a[0] * a[1] + a[2]) & mask
            elif name == "div": R[d] = a[0] // a[1]
            elif name == "rem": R[d] = a[0] % a[1]
            elif name == "shl": R[d] = (a[0] << a[1]) & mask
            elif name == "shr": R[d] = a[0] >> a[1]
            elif name == "and": R[d] = a[0] & a[1]
            elif name == "or": R[d] = a[0] | a[1]
            elif name == "xor": R[d] = a[0] ^ a[1]
            elif name == "min": R[d] = min(a[0], a[1])
            elif name == "max": R[d] = max(a[0], a[1])
            elif name == "cvt": R[d] = a[0]
            else: raise RuntimeError(f"op {op} in {k.ins[pc-1]}")

class GMem:
    """Global memory: one numpy byte heap; arrays placed 256-aligned."""
    def __init__(self):
        self.heap = np.zeros(0, np.uint8); self.at = 256
        self.chunks = []
    def put(self, arr):
        b = np.ascontiguousarray(arr).view(np.uint8).ravel()
        addr = -(-self.at // 256) * 256
        self.chunks.append((addr, b.copy()))
        self.at = addr + len(b)
        return addr
    def build(self):
        self.heap = np.zeros(self.at + 256, np.uint8)
        for addr, b in self.chunks: self.heap[addr:addr + len(b)] = b
        return self.heap
    def get(self, addr, shape, dtype=np.float32):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.heap[addr:addr + n].view(dtype).reshape(shape).copy()
