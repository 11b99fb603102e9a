"""The bytes one decode token reads, by part: the ceiling `bench decode` sets decode against (read
bandwidth / bytes a token), and what speculative decoding weighs to decide whether it pays
(fermijit/speculative.py `pays`).

Decode reads every weight a token needs once: every dense matrix and vector, the LM head, one
embedding row, of the routed experts those the routers selected, the KV rows attention reads, and
the GDN layers' state (the recurrent state and the conv window, read and written back every
token: 64 MB of reap128's ~2 GB, 3 %).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit import FermijitError


def arrays(obj):
    """Every numpy array inside a weight object (dataclasses, Q4Matrix, QuantTensor...)."""
    if isinstance(obj, np.ndarray):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            if field.name == "d_bits" and hasattr(obj, "d_bits"):
                yield getattr(obj, "d_bits")
            else:
                yield from arrays(getattr(obj, field.name))


@dataclasses.dataclass
class TokenBytes:
    """Weight bytes one decode token reads, by part."""

    dense: int = 0        # mixers, norms, routers, the shared experts
    experts: int = 0      # the routed experts selected
    lm_head: int = 0
    embedding: int = 0    # one row
    kv: int = 0           # the KV cache's rows attention reads (every attention layer)
    state: int = 0        # the GDN layers' recurrent and conv state (read once; written back)

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.lm_head + self.embedding + self.kv + self.state


def token_bytes(model, selected: list[int], kv_nbytes: int = 0,
                state_nbytes: int = 0) -> TokenBytes:
    """Bytes read by a decode token that selected `selected[i]` distinct experts in layer i,
    attends over `kv_nbytes` of KV rows and steps `state_nbytes` of GDN state."""
    from fermijit.model.block_moe import BlockExperts
    from fermijit.ops import moe

    out = TokenBytes(lm_head=sum(a.nbytes for a in arrays(model.lm_head)),
                     embedding=model.embed.nbytes // model.embed.shape[0], kv=kv_nbytes,
                     state=state_nbytes)
    for layer, n_selected in zip(model.layers, selected):
        experts = layer.experts
        if isinstance(experts, moe.MoeWeights):
            routed, shared = experts.routed, experts.shared
        elif isinstance(experts, BlockExperts):  # K-quant or Q8_0 experts (model/block_moe.py)
            routed = [*arrays(experts.gate_up), *arrays(experts.down)]
            shared = [*arrays(experts.shared_gate_up), *arrays(experts.shared_down)]
        else:
            raise FermijitError("bench decode needs a fermijit (4-bit) model, not an HF checkpoint")
        per_expert = sum(a.nbytes for a in routed) // routed[0].shape[0]
        out.experts += n_selected * per_expert
        shared = sum(a.nbytes for a in shared) + experts.shared_gate.nbytes
        out.dense += shared + sum(a.nbytes for a in arrays(layer.mixer)) \
            + layer.input_norm.nbytes + layer.post_norm.nbytes + layer.router.nbytes
    out.dense += model.norm.nbytes
    return out
