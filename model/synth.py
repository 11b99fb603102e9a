"""Synthetic full-size models: the exact shapes of Qwen3.6-35B-A3B (and its REAP-128 pruning) with
random weights, written straight into the converted format (model/convert.py's `write_model`), so
benchmarks can run the real sizes without the 67 GB checkpoint or a bf16 detour.

Weights are random Q4_0 blocks whose dequantised values have standard deviation GAIN / sqrt(K) for
a matrix of fan-in K: every projection of an RMS-normalised input then has outputs of RMS ~1, so
the forward stays finite over 40 layers at any size (which also makes a shrunken test model
behave like the full one). Nibbles follow a quantised normal (sigma NIBBLE_SIGMA, the spread a
Q4_0 absmax scale gives Gaussian weights: 8 / 2.07, the mean absmax of 32 normals), scales vary
per block by +-25 %. The LM head is Q8_0 (`convert`'s default), the embedding fp16.

Every block is a pure function of (seed, tensor name, block index) through splitmix64, generated
by a parallel Numba kernel and written in chunks of CHUNK_BYTES: no tensor is whole in memory,
and the bytes do not depend on the chunking or the thread count. A worker thread writes and hashes
each chunk while the kernel fills the next (both release the GIL), so synth costs about what
writing the bytes costs.

The tokenizer is byte-level: ids 0-255 are the bytes (any text encodes), the config's bos/eos id
is `<|endoftext|>`, and every other id is a filler token that decodes to " t<id>".
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
import functools
import hashlib
import json
import statistics
import time
from pathlib import Path

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit import cpu
from fermijit.model import convert
from fermijit.model.config import parse_config
from fermijit.model.manifest import Source
from fermijit.model.weights import text_weight_shapes

# The published text_config of Qwen3.6-35B-A3B (tests/model/data/qwen3.6-35b-a3b.config.json;
# a test checks they agree). layer_types follows from full_attention_interval.
REAL_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text", "attention_bias": False, "attention_dropout": 0.0,
    "attn_output_gate": True, "bos_token_id": 248044, "eos_token_id": 248044,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "output_router_logits": False, "pad_token_id": None,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                        "rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "use_cache": True,
    "vocab_size": 248320,
}
# name -> routed experts (REAP-128 keeps the 128 most salient of 256 per layer).
NAMES = {"qwen3.6-35b-a3b": 256, "qwen3.6-35b-a3b-reap128": 128}
GAIN = 1.0
NIBBLE_SIGMA = 8 / 2.07   # Q4_0 of normal weights: the block absmax (~2.07 sigma) maps to 8
Q8_SIGMA = 127 / 2.07     # Q8_0 likewise, to 127
SCALE_JITTER = 0.25       # block scales vary uniformly by +-25 % around their mean
CHUNK_BYTES = 64 << 20
BLOCK = convert.BLOCK
EOS_TEXT = "<|endoftext|>"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def config_for(name: str, layers: int | None = None, overrides: dict | None = None) -> dict:
    """The config.json of a synthetic model (text-only form). `overrides` (tests) replace fields
    to shrink it."""
    if name not in NAMES:
        raise FermijitError(f"unknown synthetic model {name!r}; choose one of {', '.join(NAMES)}")
    raw = dict(REAL_TEXT_CONFIG, num_experts=NAMES[name], **(overrides or {}))
    if layers is not None:
        if layers < 1:
            raise FermijitError(f"--layers must be at least 1, got {layers}")
        raw["num_hidden_layers"] = layers
    parse_config(raw, where=f"synthetic {name}")  # the loader's checks, before any write
    return raw


# --- random blocks ------------------------------------------------------------------------------

def _mix(z):
    """splitmix64's finaliser: a uint64 -> a well-mixed uint64."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _lut_body(out, key, first, lut):
    """out[i] = lut[16 random bits of element first + i]: splitmix64 of (key, (first + i) // 4)
    gives four elements' bits (`first` a multiple of 4). Any distribution of 65536 levels."""
    n = out.size
    g0 = first // 4
    for g in prange((n + 3) // 4):
        r = mix(key ^ (np.uint64(g0 + g) * _GOLDEN))
        if 4 * g + 4 <= n:  # unrolled: the common case
            out[4 * g] = lut[r & np.uint64(0xFFFF)]
            out[4 * g + 1] = lut[(r >> np.uint64(16)) & np.uint64(0xFFFF)]
            out[4 * g + 2] = lut[(r >> np.uint64(32)) & np.uint64(0xFFFF)]
            out[4 * g + 3] = lut[r >> np.uint64(48)]
        else:
            for j in range(n - 4 * g):
                out[4 * g + j] = lut[(r >> np.uint64(16 * j)) & np.uint64(0xFFFF)]


def _block_lut_body(out, key, first, lut, table):
    """_lut_body with a table per byte of a block: out[i] = lut[table[(first + i) % S], 16
    random bits of element first + i], S = table.size bytes a block (`first` a multiple of 4).
    A few distinct tables (lut [n, 65536] uint8: ~6, 384 KiB) stay in L2; one per byte (144 of
    them, 9 MiB) ran 5 MB/s here."""
    n = out.size
    size = table.size
    g0 = first // 4
    for g in prange((n + 3) // 4):
        r = mix(key ^ (np.uint64(g0 + g) * _GOLDEN))
        for j in range(min(4, n - 4 * g)):
            i = 4 * g + j
            out[i] = lut[table[(first + i) % size], (r >> np.uint64(16 * j)) & np.uint64(0xFFFF)]


_kernels = None


def _get_kernel(per_block_byte: bool = False):
    global _kernels
    if _kernels is None:
        mix = cpu.kernel(_mix, fastmath=False)
        _kernels = (cpu.kernel(_lut_body, parallel=True, fastmath=False, variant="lut", mix=mix),
                    cpu.kernel(_block_lut_body, parallel=True, fastmath=False, variant="lut",
                               mix=mix))
    return _kernels[per_block_byte]


@functools.lru_cache(maxsize=None)
def _normal_quantiles(levels: int) -> np.ndarray:
    """The centre quantiles of N(0, 1) at `levels` equiprobable levels: a uniform random index
    into them is a normal draw (to 1/levels in probability)."""
    inv = statistics.NormalDist().inv_cdf
    return np.array([inv((i + 0.5) / levels) for i in range(levels)])


def _quantised_normal(sigma: float, limit: int, levels: int) -> np.ndarray:
    """round(N(0, sigma)) clipped to [-limit, limit], as `levels` equiprobable values."""
    return np.clip(np.rint(sigma * _normal_quantiles(levels)), -limit, limit).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How one quantisation's blocks are drawn: 16 random bits -> a qs byte, and the std of the
    values an element takes before its scale."""

    lut_qs: np.ndarray   # uint8 [65536]
    unit_std: float
    qs_per_block: int    # bytes


@functools.lru_cache(maxsize=None)
def _kind(quant: str) -> _Kind:
    idx = np.arange(1 << 16)
    if quant == "q4_0":  # two nibbles of 8 bits each, symmetric about Q4_0's zero point 8
        nib = _quantised_normal(NIBBLE_SIGMA, 7, 256)
        lut = (nib[idx & 0xFF] + 8) | ((nib[idx >> 8] + 8) << 4)
        return _Kind(lut.astype(np.uint8), float(np.std(nib)), BLOCK // 2)
    q8 = _quantised_normal(Q8_SIGMA, 127, 1 << 16)
    return _Kind(q8.astype(np.int8).view(np.uint8), float(np.std(q8)), BLOCK)


def _scale_lut(std: float, kind: _Kind) -> np.ndarray:
    """65536 fp16 scales (as uint16 bits) spread uniformly by +-SCALE_JITTER about their mean,
    such that the dequantised elements have standard deviation `std`."""
    jitter = 1 + SCALE_JITTER * (2 * (np.arange(1 << 16) + 0.5) / (1 << 16) - 1)
    mean = std / (kind.unit_std * np.sqrt(np.mean(jitter ** 2)))
    return (mean * jitter).astype(np.float16).view(np.uint16)


# --- GGUF block kinds (synth --quant q4_k_m) ------------------------------------------------------
# A block's bytes are drawn each from a table of its own position (_block_lut_body), so the
# fields are independent draws: the fp16 scales' high and low bytes apart (the high byte sets the
# magnitude: a value within the jitter, to the resolution of its two top mantissa bits), Q4_K's
# scale and min of a sub-block apart (both 6-bit values in 48..63, dmin 8·d on average, so
# d·sc·q − dmin·m is centred like Q4_0's (q − 8)·d in expectation; a sub-block's offset from it,
# from the draws' spread, is ~1/4 of its values' std with the super-block scales jittered by
# +-K_SCALE_JITTER, 1/2 at Q4_0's +-25 %), Q6_K's 2-bit high parts from (2, 6, 6, 2)/16 over
# Q4_0's low nibbles (q − 32 centred, bell-shaped in −32..31), int8 scales 64..127.
K_SCALE_JITTER = 0.05
Q6_HIGH_TWO_BITS = np.repeat(np.arange(4), (2, 6, 6, 2))


def _fp16_byte_luts(std_unit: float) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) byte tables of fp16 scales jittered +-K_SCALE_JITTER about `std_unit`."""
    jitter = 1 + K_SCALE_JITTER * (2 * (np.arange(1 << 16) + 0.5) / (1 << 16) - 1)
    bits = (std_unit * jitter).astype(np.float16).view(np.uint16)
    return (bits & 0xFF).astype(np.uint8), (bits >> 8).astype(np.uint8)


def _block_positions(quant: str, d_mean: float) -> list[np.ndarray]:
    """One uint8 table of 65536 per byte of a `quant` block, its scale d about `d_mean`."""
    idx = np.arange(1 << 16)
    uniform = (idx & 0xFF).astype(np.uint8)
    nibbles = _kind("q4_0").lut_qs                                  # Q4_0's: q − 8 ~ N(0, σ)
    d_lo, d_hi = _fp16_byte_luts(d_mean)
    if quant == "q4_k":  # d, dmin, 8 scale bytes (6-bit value | top bits of j+4's: 3), 4, qs
        m_lo, m_hi = _fp16_byte_luts(8 * d_mean)
        six = ((3 << 6) | (48 + (idx & 15))).astype(np.uint8)
        return [d_lo, d_hi, m_lo, m_hi] + [six] * 8 + [uniform] * 4 + [nibbles] * 128
    if quant == "q6_k":  # ql (two low nibbles), qh (four 2-bit high parts), int8 scales, d
        high = sum(Q6_HIGH_TWO_BITS[(idx >> (4 * k)) & 15] << (2 * k) for k in range(4))
        scales = (64 + (idx & 63)).astype(np.uint8)
        return [nibbles] * 128 + [high.astype(np.uint8)] * 64 + [scales] * 16 + [d_lo, d_hi]
    if quant == "q5_0":  # d, the fifth bits (uniform), the low nibbles: q − 16 centred
        return [d_lo, d_hi] + [uniform] * 4 + [nibbles] * 16
    raise FermijitError(f"synth: no random {quant} blocks (a mix's kinds for these shapes)")


def _tables(positions: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct tables uint8 [n, 65536], each byte's table index int64 [S])."""
    distinct: list[np.ndarray] = []
    index = []
    for lut in positions:
        at = next((i for i, d in enumerate(distinct) if d is lut), None)
        if at is None:
            at = len(distinct)
            distinct.append(lut)
        index.append(at)
    return np.ascontiguousarray(np.stack(distinct)), np.array(index, np.int64)


@functools.lru_cache(maxsize=None)
def _block_lut(quant: str, std: float) -> tuple[np.ndarray, np.ndarray]:
    """The byte tables (_tables) of random `quant` blocks whose dequantised values have
    standard deviation `std` in a sample of 4096 blocks: d's mean found by bisection (the fp16
    bytes drawn apart make the std a continuous but not proportional function of it)."""
    from fermijit.ops import kquant

    fmt = kquant.FORMATS[quant]
    draw = np.random.default_rng(0).integers(0, 1 << 16, (4096, fmt.block_bytes))

    def sample_std(d_mean: float) -> float:
        sample = np.stack(_block_positions(quant, d_mean))[np.arange(fmt.block_bytes), draw]
        return float(kquant.dequantize(fmt, sample.reshape(-1)).std())

    guess = std / sample_std(1.0)
    lo, hi = guess / 2, guess * 2
    for _ in range(24):                                # to 2^-24 of the bracket
        mid = np.sqrt(lo * hi)
        lo, hi = (mid, hi) if sample_std(mid) < std else (lo, mid)
    return _tables(_block_positions(quant, np.sqrt(lo * hi)))


def _normal_lut(std: float, dtype) -> np.ndarray:
    """65536 levels of N(0, std) in `dtype` (fp16 as its uint16 bits, for the kernel)."""
    lut = (std * _normal_quantiles(1 << 16)).astype(dtype)
    return lut.view(np.uint16) if lut.dtype == np.float16 else lut


def _key(seed: int, name: str) -> np.uint64:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


# --- what each tensor holds ---------------------------------------------------------------------

def _random(out, stored: str, lut, seed: int, n: int, step: int, digest):
    """Tensor `stored` of n elements, each lut[16 random bits] (or, lut = (tables, index) of
    _block_lut, byte i of a block from tables[index[i % S]]), written `step` at a time and
    hashed into `digest`; yields the elements done per piece."""
    per_block_byte = isinstance(lut, tuple)
    kernel = _get_kernel(per_block_byte)

    def fill(piece, key, i0, lut):
        return kernel(piece, key, i0, *lut) if per_block_byte else kernel(piece, key, i0, lut)

    key = _key(seed, stored)
    bufs = [np.empty(min(n, step), lut[0].dtype if per_block_byte else lut.dtype)
            for _ in range(2)]
    dtype = out.dtype_of(stored)

    def write(piece, i0):
        out.write(stored, piece.view(dtype), start=i0)

    # pwrite and sha256 release the GIL, as the fill kernel does: piece i is written and hashed
    # (one worker each, so the hash sees pieces in order) while piece i + 1 is filled.
    with ThreadPoolExecutor(1) as writer, ThreadPoolExecutor(1) as hasher:
        pending = []
        for k, i0 in enumerate(range(0, n, step)):
            m = min(step, n - i0)
            piece = bufs[k % 2][:m]
            fill(piece, key, i0, lut)
            for job in pending:
                job.result()  # the other buffer is free again
            pending = [writer.submit(write, piece, i0),
                       hasher.submit(digest.update, piece.view(np.uint8))]
            yield m
        for job in pending:
            job.result()


def _fill(name: str, shape: tuple[int, ...], quant: str, seed: int, out, checksums: dict):
    """Generate and write tensor `name`; yields its elements done per piece. Its sha256 goes to
    `checksums[name]` (the bytes in the manifest's order: qs, then d)."""
    digest = hashlib.sha256()
    yield from _fill_hashed(name, shape, quant, seed, out, digest)
    checksums[name] = digest.hexdigest()


def _fill_hashed(name: str, shape: tuple[int, ...], quant: str, seed: int, out, digest):
    field = name.rsplit(".", 1)[-1]
    K = shape[-1]
    n = int(np.prod(shape))
    if quant not in ("q4_0", "q8_0", "f16", "f32"):                 # a GGUF block kind
        from fermijit.ops import kquant

        fmt = kquant.FORMATS[quant]
        lut = _block_lut(quant, 1.0 if name == "embed_tokens" else GAIN / np.sqrt(K))
        n_bytes = n // fmt.block_values * fmt.block_bytes
        step = CHUNK_BYTES // (4 * fmt.block_bytes) * 4 * fmt.block_bytes  # whole blocks
        yield from (m * fmt.block_values // fmt.block_bytes for m in _random(
            out, name + ".blocks", lut, seed, n_bytes, step, digest))
        return
    if quant in ("q4_0", "q8_0"):
        kind = _kind(quant)
        n_blocks = n // BLOCK
        step = CHUNK_BYTES // kind.qs_per_block                   # blocks per piece
        yield from (m * BLOCK // kind.qs_per_block for m in _random(
            out, name + ".qs", kind.lut_qs, seed, n_blocks * kind.qs_per_block,
            step * kind.qs_per_block, digest))
        for _ in _random(out, name + ".d", _scale_lut(GAIN / np.sqrt(K), kind), seed,
                         n_blocks, step, digest):
            pass
        return
    if field in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                 "pre_fc_norm_embedding", "pre_fc_norm_hidden") or name in ("norm", "mtp.norm"):
        values = np.zeros(shape)                        # zero-centred: scale 1 + w = 1
    elif field in ("norm", "dt_bias"):                  # the GDN's gated norm: a plain weight
        values = np.ones(shape)
    elif field == "A_log":                              # HF's init: A ~ U(0, 16), A_log = log A
        values = np.log(np.random.default_rng(int(_key(seed, name))).uniform(1, 16, shape))
    elif field == "conv1d":                             # Conv1d's default init, fan-in Kc
        values = np.random.default_rng(int(_key(seed, name))).uniform(-1, 1, shape) / np.sqrt(K)
    else:  # the embedding (rows of RMS 1, as the normed inputs), router, gates: N(0, GAIN^2/K)
        std = 1.0 if name == "embed_tokens" else GAIN / np.sqrt(K)
        lut = _normal_lut(std, np.float16 if quant == "f16" else np.float32)
        yield from _random(out, name, lut, seed, n, CHUNK_BYTES // lut.itemsize, digest)
        return
    values = values.astype(np.float16 if quant == "f16" else np.float32)
    out.write(name, values)
    digest.update(values.view(np.uint8))
    yield n


# --- the tokenizer ------------------------------------------------------------------------------

def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> a printable character (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(dst: Path, vocab_size: int, eos_id: int) -> None:
    """tokenizer.json (byte-level, every id 0..vocab_size-1 decodable) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 257 or not 256 <= eos_id < vocab_size:
        raise FermijitError(f"a synthetic tokenizer needs vocab_size > 256 and eos in [256, "
                            f"vocab_size), got {vocab_size} and {eos_id}")
    alphabet = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(alphabet)}
    space = alphabet[ord(" ")]
    vocab.update({f"{space}t{i}": i for i in range(256, vocab_size) if i != eos_id})
    vocab[EOS_TEXT] = eos_id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TEXT, special=True, normalized=False)])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS_TEXT, "bos_token": None, "model_max_length": 262144}, indent=1) + "\n")


# --- the command --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Written:
    path: Path
    nbytes: int
    seconds: float

    def summary(self) -> str:
        return (f"wrote {self.path}: {self.nbytes / 1e9:.2f} GB in {self.seconds:.1f} s "
                f"({self.nbytes / 1e9 / self.seconds:.2f} GB/s)")


def synth(name: str, dst: str | Path, layers: int | None = None, seed: int = 0,
          overrides: dict | None = None, show_progress: bool = True,
          mix: str = "q4_0", lm_head: str | None = None) -> Written:
    """Write the synthetic model `name` (see NAMES) into the new directory `dst`, its weights
    in the kinds of quantisation mix `mix` (model/quant_mix.py), its LM head's `lm_head` where
    given (as convert's)."""
    dst = Path(dst)
    raw = config_for(name, layers, overrides)
    cfg = parse_config(raw).text_config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    shapes = text_weight_shapes(cfg, mtp=cfg.mtp_num_hidden_layers == 1)  # the real: one
    quants = convert.mix_quants(cfg, shapes, mix, lm_head)
    for quant in set(quants.values()) - {"q4_0", "q8_0", "f16", "f32"}:
        _block_positions(quant, 1.0)                   # a kind it cannot draw: before any write

    def other_files(out: Path) -> None:
        (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "do_sample": False}) + "\n")
        write_tokenizer(out, cfg.vocab_size, eos)

    start = time.perf_counter()
    checksums: dict[str, str] = {}  # filled as the tensors are written: no read-back pass
    convert.write_model(dst, shapes, quants["lm_head"],
                        lambda n, out: _fill(n, shapes[n], quants[n], seed, out, checksums),
                        source=Source(path=f"synthetic:{name}",
                                      fingerprint=f"seed {seed}, {cfg.num_hidden_layers} layers",
                                      files=(), format="synthetic"),
                        other_files=other_files, desc=f"synth {name}",
                        show_progress=show_progress, checksums=checksums, quants=quants, mix=mix)
    seconds = time.perf_counter() - start
    return Written(dst, (dst / convert.WEIGHTS).stat().st_size, seconds)


def layer_stats(model, tokens: np.ndarray) -> list[dict]:
    """Per layer, over a prefill of `tokens` on a fresh state: the RMS of the residual stream
    after it and the number of distinct experts its router chose: what the scales above are
    checked by (finite, not growing without bound, routing not collapsed onto a few experts)."""
    rows = []
    moe = model.moe

    def watched(w, ws):
        moe(w, ws)
        x = ws.x + ws.y
        rows.append({"rms": float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))),
                     "experts": int(np.unique(ws.ids).size)})

    model.moe = watched  # an instance attribute shadows the method for this prefill only
    try:
        model.prefill(tokens, model.new_state(tokens.size))
    finally:
        del model.moe
    return rows
