"""The gpt model of the language spec as dataflow: operators, tensors, parameters, FLOPs.

Sizes here are per microbatch and per rank *before* tensor parallelism (after context
parallelism: each cp rank holds ``seq / cp`` tokens and attends to all ``seq``).
FLOPs count a multiply-add as two, as Narayanan et al. (SC'21, section 5.1) do; the
causal mask is not subtracted, as in their formula. Backward costs twice the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.plan import Plan

# Operators of one transformer block, in forward order, and the dims of their outputs.
LAYER_OPS = ("ln1", "qkv", "attention", "proj", "attn_residual",
             "ln2", "fc1", "gelu", "fc2", "mlp_residual")
OP_KIND = {"attn_residual": "residual", "mlp_residual": "residual"}  # node attribute `op`

# (weight dims, bias dims) of the linear layers, as ``x @ W + b`` with W (in, out).
LINEAR_DIMS = {
    "qkv": ("hidden", "qkv"),
    "proj": ("hidden", "hidden"),  # input features are the attention heads, head-major
    "fc1": ("hidden", "ffn"),
    "fc2": ("ffn", "hidden"),
    "head": ("hidden", "vocab"),
}


@dataclass(frozen=True)
class Parameter:
    name: str  # e.g. "layers.3.qkv.weight"
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    layer: int | None


@dataclass(frozen=True)
class Shapes:
    """Tensor sizes of one microbatch on one cp rank, before tensor parallelism."""

    batch: int  # microbatch size
    seq: int  # local tokens per cp rank
    seq_full: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    dtype_bytes: int

    @staticmethod
    def of(plan: Plan) -> "Shapes":
        m = plan.model
        return Shapes(plan.microbatch_size, m.seq // plan.mesh.cp, m.seq, m.hidden, m.heads,
                      m.ffn, m.vocab, m.dtype_bytes)

    def elements(self, tensor: str) -> int:
        """Elements of an activation: stream/qkv/ffn/logits are (batch, seq, features)."""
        width = {"stream": self.hidden, "qkv": 3 * self.hidden, "ffn": self.ffn,
                 "logits": self.vocab, "kv": 2 * self.hidden, "tokens": 1}[tensor]
        return self.batch * self.seq * width

    def bytes(self, tensor: str) -> int:
        return self.elements(tensor) * self.dtype_bytes


# Which activation each operator produces.
OUTPUT_TENSOR = {
    "embedding": "stream", "position": "stream", "ln1": "stream", "qkv": "qkv",
    "attention": "stream", "proj": "stream", "attn_residual": "stream", "ln2": "stream",
    "fc1": "ffn", "gelu": "ffn", "fc2": "stream", "mlp_residual": "stream",
    "final_ln": "stream", "head": "logits", "loss": "tokens",
}


def forward_flops(op: str, s: Shapes) -> float:
    """FLOPs of one operator for one microbatch on one cp rank (all tp ranks together)."""
    bs = s.batch * s.seq
    h = s.hidden
    return {
        "embedding": 0.0,
        "position": bs * h,
        "ln1": 5.0 * bs * h, "ln2": 5.0 * bs * h, "final_ln": 5.0 * bs * h,
        "qkv": 2.0 * bs * h * 3 * h,
        # Q K^T and softmax(.) V over all keys, plus the softmax itself.
        "attention": 4.0 * bs * s.seq_full * h + 5.0 * bs * s.heads * s.seq_full,
        "proj": 2.0 * bs * h * h,
        "attn_residual": bs * h, "mlp_residual": bs * h,
        "fc1": 2.0 * bs * h * s.ffn,
        "gelu": 8.0 * bs * s.ffn,
        "fc2": 2.0 * bs * s.ffn * h,
        "head": 2.0 * bs * h * s.vocab,
        "loss": 5.0 * bs * s.vocab,
    }[op]


def layer_parameters(plan: Plan, layer: int) -> list[Parameter]:
    m = plan.model
    h = m.hidden
    prefix = f"layers.{layer}."
    shapes = [
        ("ln1.weight", (h,), ("hidden",)), ("ln1.bias", (h,), ("hidden",)),
        ("qkv.weight", (h, 3 * h), LINEAR_DIMS["qkv"]), ("qkv.bias", (3 * h,), ("qkv",)),
        ("proj.weight", (h, h), LINEAR_DIMS["proj"]), ("proj.bias", (h,), ("hidden",)),
        ("ln2.weight", (h,), ("hidden",)), ("ln2.bias", (h,), ("hidden",)),
        ("fc1.weight", (h, m.ffn), LINEAR_DIMS["fc1"]), ("fc1.bias", (m.ffn,), ("ffn",)),
        ("fc2.weight", (m.ffn, h), LINEAR_DIMS["fc2"]), ("fc2.bias", (h,), ("hidden",)),
    ]
    return [Parameter(prefix + name, shape, dims, layer) for name, shape, dims in shapes]


def embedding_parameters(plan: Plan) -> list[Parameter]:
    m = plan.model
    return [Parameter("embedding.weight", (m.vocab, m.hidden), ("vocab", "hidden"), None),
            Parameter("position.weight", (m.seq, m.hidden), ("seq", "hidden"), None)]


def head_parameters(plan: Plan) -> list[Parameter]:
    """The final LayerNorm and the head; a tied head shares embedding.weight (transposed)."""
    m = plan.model
    params = [Parameter("final_ln.weight", (m.hidden,), ("hidden",), None),
              Parameter("final_ln.bias", (m.hidden,), ("hidden",), None)]
    if not m.tie_embeddings:
        params.append(Parameter("head.weight", (m.hidden, m.vocab), LINEAR_DIMS["head"], None))
    return params


def all_parameters(plan: Plan) -> list[Parameter]:
    params = embedding_parameters(plan)
    for layer in range(plan.model.layers):
        params.extend(layer_parameters(plan, layer))
    return params + head_parameters(plan)
