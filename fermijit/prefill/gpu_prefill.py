"""The GPU prefill: the forward of model/forward.py over a whole prompt on the GPU, the
dense weights resident, the routed experts streamed from host memory
(fermijit/prefill/expert_stream.py), and the state handed to the CPU `State` for decode
(fermijit/prefill/gpu_state.py).

Per layer, on the legacy stream (the ops' launches):
    xn = rmsnorm(x);  x += mixer(xn)           (GDN or attention; the output projection adds into
                                                x: the expert_down GEMM with one expert, every
                                                token routed to it with weight 1)
    xn = rmsnorm(x);  router top-k of layer i, and of layer i+1 on the same xn (a prediction)
                                               (the ids come to the host: the one sync per layer)
    copy stream: the routed experts of layer i not yet on the device, then the experts predicted
                 for layer i+1 into the other buffer of the pair (double buffer)
    x += σ(xn·w_sg) · shared(xn);  wait for layer i's copies;  x += routed experts(xn)
then the final norm and the LM head for the last position. A pass may hold several sequences'
rows (`Segment`: what carries state runs per sequence), and the MTP head's rows run after the
layers as one more (`Pass.head`), where the states have the head. A layer's routing needs its own input,
so its copies could not start before its router ran; predicting it from the layer before (the
residual stream changes little per layer) lets the copies of layer i+1 run under the experts of
layer i and the mixer of layer i+1. A wrong prediction costs bytes, never correctness: whatever
the real routing needs and the prediction missed is copied after routing, before the GEMMs. On a
long prompt every expert is routed (947 tokens x 8 of 128: each expert unused with probability
(120/128)^947 ~ 1e-27 under uniform routing), so the prediction is then exact.

Numerics: by default every GEMM input is rounded to Q8_0 per 32-block exactly
as the CPU prefill rounds it (ops/act_quant.py: the same codes and scales, bit for bit) wherever
the CPU's W4A8 products do: the mixers' input and output projections, the shared and routed
experts' gate_up inputs and their down inputs after SwiGLU, the LM head's input. The router and
the gates read fp32, as on the CPU. So the logits and the handed-off state follow the all-CPU
path (and model/reference.py with quantised activations) to fp32 rounding, except where a value
lands on the other side of an 8-bit rounding boundary; a trained model cascades such flips to
~1e-2 (tests/fermijit/prefill/test_hybrid_gpu.py W4A8_CASCADE). With `w4a8=False` the activations
stay fp32 (the logits then follow model/reference.py without activation rounding).

GGUF block weights (issue 34: a Q4_K_M model's Q4_K and Q6_K as imported, a Q5_K_M's Q5_K, and
the fallbacks Q5_0, Q5_1, Q8_0) run through kernels_ptx/kquant_gemm.ptx (ops/kquant_gemm.py),
each projection's input rounded as the CPU's product of its format rounds it: Q8_K per 256 for
the K-quants (ops/act_quant.py q8_k_gpu), Q8_0 per 32 otherwise (`inputs`: xn rounded once per
rounding that reads it).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np

from fermijit.jit import checks
from fermijit.model.forward import L2NORM_EPS, Model
from fermijit.model.reap import moe_layers
from fermijit.ops import (act_quant, attention, conv1d, embedding, expert_matmul, f32_gemm,
                          gated_delta, kquant_gemm, l2norm, matmul, rmsnorm, rope, router)
from fermijit.prefill.gpu_layout import (F32, dense_arrays, dense_kinds, expert_dims,
                                         has_k_quants, head_arrays, head_kind, route_slots)


class DeviceModel:
    """The dense weights on the GPU, uploaded once; the expert buffer; the copy streamer."""

    def __init__(self, model: Model, source: str, ring_slot_bytes: int = 64 << 20,
                 host: dict | None = None):
        """`source`: expert_stream.SOURCES; "pinned" (the whole pool page-locked) registers the
        model file's pages in place where the driver can, else copies them into a pool that CPU
        decode then reads too (its expert arrays rebound to it): one copy in host RAM. `host`:
        the page-locked host buffers by name (`host_buffer`), some perhaps made already (the
        server's hand-off room, page-locked ahead: hybrid.GpuPrefiller.reserve)."""
        from fermijit.jit import gpu
        from fermijit.prefill import expert_stream

        # The experts first: registering the model file page-locks the dense weights' pages
        # too, so their uploads below run as DMA (the LM head's 0.5 GB included).
        start = time.perf_counter()
        self.model = model
        self.streamer = expert_stream.Streamer([w.experts for w in moe_layers(model)],
                                               "mapped" if source == "pinned" else source,
                                               ring_slot_bytes)
        rebound = tuple(dataclasses.replace(w, experts=self.streamer.rebind(i, w.experts))
                        for i, w in enumerate(moe_layers(model)))
        model.layers = rebound[:len(model.layers)]
        if model.mtp is not None:  # its layer is the streamer's layer L
            model.mtp = dataclasses.replace(model.mtp, layer=rebound[-1])
        self.prepare_s = {f"experts ({self.streamer.source})": time.perf_counter() - start}
        start = time.perf_counter()
        # One allocation and a copy stream's queue for all of them (gpu.upload): ~800 arrays at
        # full size, each uploaded by itself (an allocation, a copy releasing the GIL) took
        # 0.72-0.96 s beside the CPU kernels' warm-up on the H200's host.
        layers, head = dense_arrays(model), head_arrays(model)
        checks.check_array("gpu prefill", "norm", model.norm, np.float32)
        arrays = ([np.ascontiguousarray(v) for a in layers for v in a.values()]
                  + [np.ascontiguousarray(model.norm)]
                  + [np.ascontiguousarray(v) for v in head.values()])
        on_device = iter(gpu.upload("gpu prefill", arrays))
        self.layers = [{k: next(on_device) for k in a} for a in layers]
        self.norm = next(on_device)
        self.head = {k: next(on_device) for k in head}
        # Each projection's GEMM per layer (q4_0, or a K-quant: gpu_layout.kind), the head's.
        self.kinds = dense_kinds(model)
        self.head_kind = head_kind(model)
        self.has_k_quants = has_k_quants(model)
        self.prepare_s["dense weights"] = time.perf_counter() - start
        self.expert_buffers = [gpu.empty((self.streamer.layer_bytes,), np.uint8)
                               for _ in range(2)]  # layer i in buffer i % 2
        self.readback = gpu.copy_stream()  # device-to-host routing reads (Pass.read_routing)
        self._host: dict[str, np.ndarray] = {} if host is None else host
        self.resident_bytes = (sum(a.nbytes for layer in self.layers for a in layer.values())
                               + self.norm.nbytes + sum(a.nbytes for a in self.head.values()))

    def sample(self) -> "DeviceModel":
        """A view of this model over `warm_layers` (the same device arrays, buffers and copy
        stream): a pass over it loads every kernel module a pass over the whole model does, as
        the CPU's warm-up takes one layer of each kind (fermijit/warm.py), for the start's
        2-token pass (hybrid.GpuPrefiller._prepare), whose 40 layers at full size held the GIL
        beside the CPU kernels' load. Without the MTP head (that pass's state has none)."""
        from fermijit.warm import with_layers

        keep = warm_layers(self.model.is_attention, self.kinds)
        view = copy.copy(self)
        view.model = with_layers(self.model, keep)
        view.model.mtp = None
        view.layers = [self.layers[i] for i in keep]
        view.kinds = [self.kinds[i] for i in keep]
        view.streamer = self.streamer.subset(keep)
        return view

    def host_buffer(self, name: str, nbytes: int) -> np.ndarray:
        """A page-locked host buffer of at least `nbytes`, kept for the next pass (page-locking
        is slow: a few ms)."""
        return host_buffer(self._host, name, nbytes)


def warm_layers(is_attention: tuple, kinds: list[dict]) -> list[int]:
    """The first layer of each kind: GDN or attention with each projection's and the experts'
    GEMM kinds (`kinds`: DeviceModel.kinds, a K-quant mix gives some layers' down projections
    another format). Layers of a kind differ in their weights only, so they launch the same
    kernels."""
    first: dict = {}
    for i, (attention_layer, k) in enumerate(zip(is_attention, kinds)):
        first.setdefault((attention_layer, tuple(sorted(k.items()))), i)
    return sorted(first.values())


def host_buffer(buffers: dict, name: str, nbytes: int) -> np.ndarray:
    """`buffers[name]`, page-locked, grown to at least `nbytes` (DeviceModel.host_buffer)."""
    from fermijit.jit import gpu

    buf = buffers.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = buffers[name] = gpu.pinned(max(nbytes, 64 << 10))
    return buf


@dataclasses.dataclass
class LayerTiming:
    """CUDA events of one layer of one pass (for `bench prefill --verbose`)."""

    compute: tuple  # (start, end) on the legacy stream
    copy: tuple     # (start, end) on the copy stream, or () when nothing was copied


@dataclasses.dataclass
class Segment:
    """One sequence's rows of a pass. A pass runs several sequences' rows together
    (hybrid.GpuPrefiller.prefill_batch): what reads weights (norms, projections, router,
    experts: each layer's experts fetched once for all the rows) over all its rows, what carries
    a sequence's state (the conv and the delta rule, attention over its KV cache, RoPE
    positions) per segment, as Model.prefill_batch does on the CPU."""

    rows: slice           # its rows of the pass
    start: int            # positions its state holds before them
    states: list          # its device states per layer (gpu_state.upload_states), the MTP
    #                       head's KV cache last where the state has the head
    waiting: object = None  # with the head: its hidden states waiting (model/mtp.py), device
    #                         [w, H], w = 0 (a fresh state) or 1; the pass leaves its last there


def copy_rows(dst, src) -> None:
    """Device rows [n, ...] of src into dst, as many, on the legacy stream."""
    from fermijit.jit import gpu

    if src.shape[0]:
        width = src.nbytes // src.shape[0]
        gpu.copy_2d(dst.gpudata, width, src.gpudata, width, width, src.shape[0])


class Pass:
    """The device buffers of one prefill pass over the rows of `segments` (one or several
    sequences); with the MTP head where their states have it (all of them or none)."""

    def __init__(self, dev: DeviceModel, segments: list[Segment], observe: bool = False,
                 w4a8: bool = True):
        from fermijit.jit import gpu

        m = dev.model
        self.dev, self.m, self.segments = dev, m, segments
        self.T = T = segments[-1].rows.stop
        H = m.hidden
        self.has_head = segments[0].waiting is not None
        self.n_layers = len(m.layers) + self.has_head      # the head's is layer L (moe_layers)
        e = gpu.empty
        self.x, self.xn = e((T, H)), e((T, H))
        self.w4a8 = w4a8
        self.xq = e((T, H)) if w4a8 else self.xn   # xn as the projections read it (`rounded`)
        self.xk = e((T, H)) if w4a8 and dev.has_k_quants else self.xn  # ... in Q8_K (`inputs`)
        self.logits_r = e((T, m.n_experts))
        self.ids, self.weights = e((T, m.top_k), np.int32), e((T, m.top_k))
        inter, shared_inter = expert_dims(m.layers[0].experts)
        self.h = e((T * m.top_k, inter))
        self.h_shared = e((T, shared_inter))
        self.shared_w = e((T, 1))
        rows = np.arange(T, dtype=np.int32)
        tiles = np.array([(0, s, min(s + expert_matmul.TILE_ROWS, T), 0)
                          for s in range(0, T, expert_matmul.TILE_ROWS)], np.int32)
        op = "gpu prefill"
        self.rows = gpu.to_device(op, "rows", rows, np.int32)
        self.tiles = gpu.to_device(op, "tiles", tiles, np.int32)
        self.ones = gpu.to_device(op, "ones", np.ones(T * m.top_k, np.float32), np.float32)
        self.n_tiles = len(tiles)
        self.positions = np.concatenate([np.arange(s.start, s.start + s.rows.stop - s.rows.start)
                                         for s in segments]).astype(np.int64)
        self.out = e((T, H))                 # rmsnorm(x) after the last layer: the LM head's input
        self.is_pad = np.zeros(T, bool)      # the head's rows that are no prediction (`head`)
        self.time_layers = False
        self.timings: list[LayerTiming] = []
        self.copy_events: tuple = ()
        self.prediction: int | None = None
        self.layer_stats: list[dict] = []    # per layer: routed slots, experts copied
        self.ids_next = e((T, m.top_k), np.int32)   # the routing predicted for the next layer
        self.weights_next = e((T, m.top_k))
        self.logits_next = e((T, m.n_experts))
        self.on_device: dict[int, tuple] = {}  # layer -> (experts copied, events, first event)
        self.marks: list | None = None       # (layer, category, event) in order, when profiling
        self.layer = -1
        self.routed = gpu.event()            # after the router: the readback waits for it
        S = T * m.top_k                      # slots; a tile per 64 of them, plus a partial one
        self.slot_rows, self.slot_weights = e((S,), np.int32), e((S,))  # per expert at most
        self.slot_tiles = e((-(-S // expert_matmul.TILE_ROWS) + m.n_experts, 4), np.int32)
        self.host_s: dict[str, float] = {}   # host seconds per routing step (bench --verbose)
        self.observing = observe             # REAP calibration (`observe`)
        self.observed: list[tuple] = []
        if observe:
            self.identity = gpu.to_device(op, "slots", np.arange(S, dtype=np.int32), np.int32)

    def mark(self, category: str) -> None:
        """Profiling: the kernels launched since the previous mark were `category`."""
        if self.marks is not None:
            from fermijit.jit import gpu

            done = gpu.event()
            done.record()
            self.marks.append((self.layer, category, done))

    # --- one layer ------------------------------------------------------------------------------

    def rounded(self, a, out=None, kind: str = "q4_0"):
        """`a` as a product with weights of `kind` reads it (8 bits per 32-block, or Q8_K per
        256 for a K-quant: the CPU's rounding), into `out` (default: in place); `a` itself with
        fp32 activations. Profiled as "act quant": the caller marks what it launched before."""
        if not self.w4a8:
            return a
        k_quant = kquant_gemm.act_kind(kind) == "q8_k"
        a = (act_quant.q8_k_gpu if k_quant else act_quant.gpu)(a, out=a if out is None else out)
        self.mark("act quant")
        return a

    def inputs(self, xn):
        """xn as each projection reads it: kind -> xn rounded for that kind's product (into xq,
        or xk for Q8_K), each rounding made once, when first asked for."""
        made = {}

        def of(kind: str):
            act = kquant_gemm.act_kind(kind)
            if act not in made:
                made[act] = self.rounded(xn, self.xk if act == "q8_k" else self.xq, kind)
            return made[act]

        return of

    @staticmethod
    def weight_arrays(w, name: str, kind: str) -> tuple:
        """A projection's device arrays as its GEMM takes them: (qs, d) for Q4_0 and Q8_0, else
        (blocks,)."""
        if kind in ("q4_0", "q8_0"):
            return w[f"{name}_qs"], w[f"{name}_d"]
        return (w[f"{name}_blocks"],)

    @staticmethod
    def dense_gemm(kind: str, x, weights: tuple, out):
        """out = x · Wᵀ for weights of `kind` (as `weights` gives them)."""
        if kind == "q4_0":
            return matmul.gpu(x, *weights, out=out)
        return kquant_gemm.gpu(kind, x, weights, out=out)

    def dense(self, w, kinds, name: str, x, out):
        """out = x · W_nameᵀ, x already rounded for it."""
        return self.dense_gemm(kinds[name], x, self.weight_arrays(w, name, kinds[name]), out)

    @staticmethod
    def expert_gemm(stage: str, kind: str, a, routing, weights: tuple, out) -> None:
        """The expert GEMM `stage` ("gate_up": out = SwiGLU rows; "down": out[rows] += weighted
        rows) for weights of `kind` (device arrays or addresses, as `weights` gives them)."""
        if kind == "q4_0":
            op = expert_matmul.gate_up_gpu if stage == "gate_up" else expert_matmul.down_gpu
            op(a, routing, *weights, out)
        else:
            op = kquant_gemm.gate_up_gpu if stage == "gate_up" else kquant_gemm.down_gpu
            op(kind, a, routing, weights, out)

    def add_projection(self, src, w, kinds, name: str) -> None:
        """x += src · W_nameᵀ: the expert_down GEMM with one expert and every token's weight 1.
        (Its k split over grid z, to fill the H200's block slots that 16 x 15 blocks leave idle,
        was measured no faster: 0.2835 s against 0.2906 median, notes/gpuprefill.md.)"""
        one = expert_matmul.Routing(self.rows, self.ones, self.tiles, self.n_tiles)
        self.expert_gemm("down", kinds[name], src, one,
                         self.weight_arrays(w, name, kinds[name]), self.x)

    def gdn(self, w, i: int) -> None:
        from fermijit.jit import gpu

        m, T = self.m, self.T
        Hk, Hv, dk, dv = m.n_key_heads, m.n_value_heads, m.key_dim, m.value_dim
        e = gpu.empty
        kinds, xin = self.dev.kinds[i], self.inputs(self.xn)
        mixed = self.dense(w, kinds, "in_proj_qkv", xin(kinds["in_proj_qkv"]),
                           e((T, m.conv_dim)))
        z = self.dense(w, kinds, "in_proj_z", xin(kinds["in_proj_z"]), e((T, Hv * dv)))
        self.mark("dense gemm")
        g, beta = f32_gemm.gates_gpu(self.xn, w["w_ba"], w["A_log"], w["dt_bias"],
                                     out=(e((T, Hv)), e((T, Hv))))
        for seg in self.segments:
            conv1d.gpu(mixed[seg.rows], w["conv1d"], seg.states[i].conv, out=mixed[seg.rows])
        parts = [e((T, Hk, dk)), e((T, Hk, dk)), e((T, Hv, dv))]
        at = 0
        for part in parts:
            width = part.nbytes // T
            gpu.copy_2d(part.gpudata, width, int(mixed.gpudata) + at, m.conv_dim * F32, width, T)
            at += width
        q, k, v = parts
        l2norm.gpu(q, L2NORM_EPS, 1 / np.sqrt(dk), out=q)
        l2norm.gpu(k, L2NORM_EPS, out=k)
        o = e((T, Hv, dv))
        self.mark("small ops")
        for seg in self.segments:
            r = seg.rows
            gated_delta.gpu(q[r], k[r], v[r], g[r], beta[r], seg.states[i].recurrent, out=o[r])
        self.mark("gated delta")
        rmsnorm.gated_gpu(o, z.reshape(T, Hv, dv), w["norm"], m.eps, out=o)
        self.mark("small ops")
        o = self.rounded(o.reshape(T, Hv * dv), kind=kinds["out_proj"])
        self.add_projection(o, w, kinds, "out_proj")
        self.mark("dense gemm")

    def attention(self, w, kinds, spans: list, positions: np.ndarray) -> None:
        """Gated attention (MODEL.md §5) of the rows at `positions` [T]; `spans`: (rows, start,
        device KvCache) per sequence, its rows' keys and values written from `start` on."""
        from fermijit.jit import gpu

        m, T, D = self.m, self.T, self.m.head_dim
        Hq, Hkv = m.n_heads, m.n_kv_heads
        e = gpu.empty
        xin = self.inputs(self.xn)
        qg = self.dense(w, kinds, "q_proj", xin(kinds["q_proj"]), e((T, Hq * 2 * D)))
        k = self.dense(w, kinds, "k_proj", xin(kinds["k_proj"]), e((T, Hkv * D)))
        v = self.dense(w, kinds, "v_proj", xin(kinds["v_proj"]), e((T, Hkv * D)))
        self.mark("dense gemm")
        q, gate = e((T, Hq, D)), e((T, Hq, D))
        for part, at in ((q, 0), (gate, D * F32)):
            gpu.copy_2d(part.gpudata, D * F32, int(qg.gpudata) + at, 2 * D * F32, D * F32, T * Hq)
        k, v = k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        rmsnorm.gpu(q, w["q_norm"], m.eps, out=q)
        rmsnorm.gpu(k, w["k_norm"], m.eps, out=k)
        rope.gpu(q, positions, m.rotary_dim, m.theta, out=q)
        rope.gpu(k, positions, m.rotary_dim, m.theta, out=k)
        for rows, start, cache in spans:
            held = cache.k.shape[1]
            for src, dst in ((k, cache.k), (v, cache.v)):  # [T, Hkv, D] -> [Hkv, S, D] rows
                for h in range(Hkv):
                    gpu.copy_2d(int(dst.gpudata) + (h * held + start) * D * F32, D * F32,
                                int(src.gpudata) + (rows.start * Hkv + h) * D * F32,
                                Hkv * D * F32, D * F32, rows.stop - rows.start)
        self.mark("small ops")
        # the flash kernel where it takes the head dim: 1.9x attention.ptx's rate at 16k tokens
        # (17.6 vs 9.5 TFLOP/s, H200, full-size heads), the same at 1k (10.2 vs 6.6)
        attend = attention.flash_gpu if D in attention.FLASH_HEAD_DIMS else attention.gpu
        o = e((T, Hq, D))
        for rows, start, cache in spans:
            attend(q[rows], cache.k, cache.v, gate[rows], start, out=o[rows])
        self.mark("attention")
        o = self.rounded(o.reshape(T, Hq * D), kind=kinds["o_proj"])
        self.add_projection(o, w, kinds, "o_proj")
        self.mark("dense gemm")

    def predict(self, layer: int, xn) -> None:
        """Start copying the experts layer `layer`'s router picks for `xn` into its buffer."""
        m = self.m
        if layer >= self.n_layers or layer in self.on_device:
            return
        f32_gemm.gpu(xn, self.dev.layers[layer]["router"], out=self.logits_next)
        router.gpu(self.logits_next, m.top_k, out=(self.ids_next, self.weights_next))
        self.prediction = layer

    def fetch(self, layer: int, experts: np.ndarray) -> None:
        """Copy `experts` (bool [E]) of `layer` not already on the device or on their way."""
        from fermijit.jit import gpu

        streamer = self.dev.streamer
        had, events, start = self.on_device.get(layer, (np.zeros_like(experts), [], None))
        missing = experts & ~had
        if missing.any():
            if start is None:
                start = gpu.event()
                start.record(streamer.stream)
            base = int(self.dev.expert_buffers[layer % 2].gpudata)
            events = events + [streamer.copy(layer, missing, base)]
        self.on_device[layer] = (had | missing, events, start)

    def read_routing(self):
        """Layer i's ids and weights, and the prediction's ids, to the host: on the readback
        stream after the router's event, so the legacy stream goes on with the shared expert
        meanwhile (a plain .get() would wait for it too)."""
        from fermijit.jit import gpu

        cuda, dev = gpu.driver(), self.dev
        dev.readback.wait_for_event(self.routed)
        out = []
        for name, a in (("ids", self.ids), ("weights", self.weights),
                        ("predicted", self.ids_next if self.prediction is not None else None)):
            if a is None:
                out.append(None)
                continue
            host = dev.host_buffer(name, a.nbytes).view(a.dtype)[:a.size].reshape(a.shape)
            cuda.memcpy_dtoh_async(host, a.gpudata, dev.readback)
            out.append(host)
        dev.readback.synchronize()
        return [None if a is None else a.copy() for a in out]

    def upload_routing(self, rows, slot_weights, tiles) -> None:
        """The sorted slots into the pass's buffers: synchronous copies from pageable memory
        (small, so the driver sends them inline; an async copy from page-locked memory queued
        behind the expert prefetch on the copy engine: 175 ms of routing against 46, hybrid.md)."""
        from fermijit.jit import gpu

        cuda = gpu.driver()
        for dst, a in ((self.slot_rows, rows), (self.slot_weights, slot_weights),
                       (self.slot_tiles, tiles)):
            cuda.memcpy_htod(dst.gpudata, np.ascontiguousarray(a))

    def moe(self, i: int, w) -> None:
        """x += shared(xn) + routed(xn); the routed experts' copies as the module says."""
        from fermijit.jit import gpu

        m, dev, E = self.m, self.dev, self.m.n_experts
        f32_gemm.gpu(self.xn, w["router"], out=self.logits_r)
        router.gpu(self.logits_r, m.top_k, out=(self.ids, self.weights))
        self.prediction = None
        self.predict(i + 1, self.xn)
        self.routed.record()
        self.mark("small ops")
        # The shared expert does not depend on the routing: launched first, it runs while the
        # host reads the routing back and sorts it.
        kinds, xin = dev.kinds[i], self.inputs(self.xn)  # the experts' input; router, gates fp32
        f32_gemm.gpu(self.xn, w["shared_gate"], "sigmoid", out=self.shared_w)
        shared = expert_matmul.Routing(self.rows, self.shared_w, self.tiles, self.n_tiles)
        kind = kinds["shared_gate_up"]
        self.expert_gemm("gate_up", kind, xin(kind), shared,
                         self.weight_arrays(w, "shared_gate_up", kind), self.h_shared)
        self.mark("shared expert")
        kind = kinds["shared_down"]
        self.expert_gemm("down", kind, self.rounded(self.h_shared, kind=kind), shared,
                         self.weight_arrays(w, "shared_down", kind), self.x)
        self.mark("shared expert")
        t0 = time.perf_counter()
        with gpu.check("reading the routing back"):
            ids, weights, predicted = self.read_routing()
        t1 = time.perf_counter()
        needed = np.bincount(ids.reshape(-1), minlength=E) > 0
        copied = dev.streamer.bytes_copied
        self.fetch(i, needed)                                  # what the prediction missed
        late = dev.streamer.bytes_copied - copied
        t2 = time.perf_counter()
        rows, slot_weights, tiles = route_slots(ids, weights, E)
        t3 = time.perf_counter()
        with gpu.check("sending the routing in"):
            self.upload_routing(rows, slot_weights, tiles)
        t4 = time.perf_counter()
        for key, dt in (("read", t1 - t0), ("fetch", t2 - t1), ("sort", t3 - t2),
                        ("upload", t4 - t3)):
            self.host_s[key] = self.host_s.get(key, 0.0) + dt
        on_device, events, copy_start = self.on_device.pop(i)
        self.layer_stats.append({"slots": int(ids.size), "experts": int(needed.sum()),
                                 "bytes": (int(on_device.sum())
                                           * dev.streamer.layouts[i].expert_bytes),
                                 "late_bytes": late,
                                 "unused_experts": int((on_device & ~needed).sum())})
        self.mark("routing (host)")
        with gpu.check(f"waiting for the experts of layer {i}"):
            for done in events:
                done.synchronize()
        self.copy_events = (copy_start, events[-1]) if events else ()
        self.mark("copy wait")
        # The layer buffer's regions (expert_stream.routed_arrays): gate_up's (qs, d, or
        # blocks), then down's.
        base = int(dev.expert_buffers[i % 2].gpudata)
        regions = tuple(base + s for s in dev.streamer.layouts[i].offsets)
        n_gu = 2 if kinds["gate_up"] in ("q4_0", "q8_0") else 1
        gu, dn = regions[:n_gu], regions[n_gu:]
        routed = expert_matmul.Routing(self.slot_rows, self.slot_weights, self.slot_tiles,
                                       len(tiles))
        self.expert_gemm("gate_up", kinds["gate_up"], xin(kinds["gate_up"]), routed, gu, self.h)
        self.mark("expert gemm")
        self.rounded(self.h, kind=kinds["down"])
        if self.observing:
            self.observe(i, ids, kinds["down"], dn, len(tiles))
        self.expert_gemm("down", kinds["down"], self.h, routed, dn, self.x)
        # The prediction's copies for layer i+1 go after these launches, off the path from the
        # routing to the GEMMs (its buffer's last reader, layer i-1's GEMMs, ran before the
        # router whose routing was read). They have layer i's GEMMs and layer i+1's mixer to run
        # under.
        if predicted is not None:
            t5 = time.perf_counter()
            self.fetch(i + 1, np.bincount(predicted.reshape(-1), minlength=E) > 0)
            self.host_s["prefetch"] = self.host_s.get("prefetch", 0.0) + time.perf_counter() - t5
        self.mark("expert gemm")

    def observe(self, i: int, ids, kind: str, down: tuple, n_tiles: int) -> None:
        """REAP calibration (model/reap.py): each slot's expert output E_j(x) without the routing
        weight (the down GEMM into a zeroed [S, H] buffer, slot s to row s, weight 1), its L2
        norm in float64 on the host, and its g_j(x) from the router's logits; kept in `observed`
        as (layer, expert of each slot, g, the norm) until the pass has succeeded. The MTP
        head's rows that predict nothing (`head`) are not counted."""
        from fermijit.jit import gpu
        from fermijit.model import reap

        S, hidden = ids.size, self.m.hidden
        y = gpu.empty((S, hidden))
        with gpu.check("clearing the expert outputs"):
            gpu.driver().memset_d32(y.gpudata, 0, S * hidden)
        each = expert_matmul.Routing(self.identity, self.ones, self.slot_tiles, n_tiles)
        self.expert_gemm("down", kind, self.h, each, down, y)
        with gpu.check("reading the expert outputs and router logits back"):
            norms = np.linalg.norm(y.get().astype(np.float64), axis=1)
            logits = self.logits_r.get()
        order = np.argsort(ids.reshape(-1), kind="stable")    # route_slots' slot order
        g = reap.gate_probabilities(logits, ids).reshape(-1)[order]
        keep = ~self.is_pad[order // ids.shape[1]]            # each slot's row
        self.observed.append((i, ids.reshape(-1)[order][keep], g[keep], norms[keep]))

    def run(self, tokens: np.ndarray, time_layers: bool = False) -> None:
        """Every layer over `tokens` [T] int32 (the segments' rows), then the MTP head's where
        the states have it; `out` holds the normed last hidden states after, and `x` the last
        residuals (the head's, where it ran)."""
        from fermijit.jit import gpu

        m = self.m
        self.time_layers = time_layers
        self.mark("start")
        x = embedding.cpu(tokens, m.embed)
        with gpu.check("copying the embeddings in"):
            self.x.set(x)
        rmsnorm.gpu(self.x, self.dev.layers[0]["post_norm"], m.eps, out=self.xn)
        self.predict(0, self.xn)                     # layer 0's experts from the embeddings
        with gpu.check("reading the routing back"):
            predicted = self.ids_next.get()
        self.fetch(0, np.bincount(predicted.reshape(-1), minlength=m.n_experts) > 0)
        self.mark("embedding")
        for i, w in enumerate(self.dev.layers[:len(m.layers)]):
            if m.is_attention[i]:
                spans = [(s.rows, s.start, s.states[i]) for s in self.segments]
                self.decoder_layer(i, w, lambda: self.attention(w, self.dev.kinds[i], spans,
                                                                self.positions))
            else:
                self.decoder_layer(i, w, lambda: self.gdn(w, i))
        rmsnorm.gpu(self.x, self.dev.norm, m.eps, out=self.out)
        self.mark("small ops")
        if self.has_head:
            self.head(tokens)

    def decoder_layer(self, i: int, w, mixer) -> None:
        """h = x + mixer(rmsnorm(x)); x = h + moe(rmsnorm(h)) (MODEL.md §4), layer i's weights
        `w`; `mixer()` adds into x from xn."""
        from fermijit.jit import gpu

        m = self.m
        self.layer = i
        start = gpu.event() if self.time_layers else None
        if start is not None:
            start.record()
        rmsnorm.gpu(self.x, w["input_norm"], m.eps, out=self.xn)
        self.mark("small ops")
        mixer()
        rmsnorm.gpu(self.x, w["post_norm"], m.eps, out=self.xn)
        self.mark("small ops")
        self.moe(i, w)
        if start is not None:
            end = gpu.event()
            end.record()
            self.timings.append(LayerTiming((start, end), self.copy_events))

    def head(self, tokens: np.ndarray) -> None:
        """The MTP head's rows (model/mtp.py, MODEL.md §10), one per row of the pass, as layer L:
        x = fc · [rmsnorm(embed(token)); rmsnorm(hidden)], then a full-attention MoE layer over
        the head's own cache. A sequence with w hidden states waiting (1, or 0 on a fresh
        state) has rows pairing hidden state p with token p + 1 from p = start - w: its waiting
        one's, then its own but the last w. With w = 0 its last row has no next token yet: it
        runs on token 0, so every buffer keeps the pass's T rows; its cache row (the sequence's
        last position) is not handed back, and a later pass's first row overwrites it."""
        from fermijit.jit import gpu

        m, T, H, L = self.m, self.T, self.m.hidden, len(self.m.layers)
        w = self.dev.layers[L]
        hidden, cat = gpu.empty((T, H)), gpu.empty((T, 2 * H))
        head_tokens, positions = np.zeros(T, np.int32), np.empty(T, np.int64)
        spans = []
        for seg in self.segments:
            a, b, n_wait = seg.rows.start, seg.rows.stop, seg.waiting.shape[0]
            copy_rows(hidden[a:a + n_wait], seg.waiting)
            copy_rows(hidden[a + n_wait:b], self.out[a:b - n_wait])
            head_tokens[a:b - 1 + n_wait] = tokens[a + 1 - n_wait:b]
            self.is_pad[b - 1 + n_wait:b] = True
            start = seg.start - n_wait
            positions[a:b] = np.arange(start, start + b - a)
            spans.append((seg.rows, start, seg.states[L]))
            seg.waiting = gpu.empty((1, H))
            copy_rows(seg.waiting, self.out[b - 1:b])
        with gpu.check("copying the embeddings in"):
            self.x.set(embedding.cpu(head_tokens, m.embed))
        rmsnorm.gpu(self.x, w["pre_fc_norm_embedding"], m.eps, out=self.xn)
        rmsnorm.gpu(hidden, w["pre_fc_norm_hidden"], m.eps, out=hidden)
        for at, half in ((0, self.xn), (H * F32, hidden)):             # [e; h], embedding first
            gpu.copy_2d(int(cat.gpudata) + at, 2 * H * F32, half.gpudata, H * F32, H * F32, T)
        self.mark("small ops")
        kinds = self.dev.kinds[L]
        self.dense(w, kinds, "fc", self.rounded(cat, kind=kinds["fc"]), self.x)
        self.mark("dense gemm")
        self.decoder_layer(L, w, lambda: self.attention(w, kinds, spans, positions))

    def logits(self, rows: list[int] | None = None) -> np.ndarray:
        """Logits [len(rows), V] of those rows of the pass (default: every row)."""
        from fermijit.jit import gpu

        m = self.m
        self.layer = self.n_layers
        xn = gpu.empty((self.T if rows is None else len(rows), m.hidden))
        if rows is None:
            copy_rows(xn, self.out)
        for k, r in enumerate(rows or ()):     # rounded below: a copy, not `out` itself
            copy_rows(xn[k:k + 1], self.out[r:r + 1])
        self.mark("small ops")
        xn = self.rounded(xn, kind=self.dev.head_kind)
        head = self.dev.head
        weights = (head["blocks"],) if "blocks" in head else (head["qs"], head["d"])
        with gpu.check("reading the logits back"):
            out = self.dense_gemm(self.dev.head_kind, xn, weights, None).get()
        self.mark("lm head")
        return out
