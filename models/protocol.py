"""The model contract: what Kiln's trainer and parallelisms expect of a model, checked at registration.

A model family is a ModelSpec (models/__init__.py) whose `model_cls(args)` builds a plain
`nn.Module` on any device, the meta device included. `register_model_spec` builds the smallest
flavor on the meta device and refuses a model that breaks the contract, naming what it lacks.

The args (one dataclass per flavor) must have
    dim, n_layers, n_heads, kv_heads, vocab_size, max_seq_len   (kv_heads may be a property)
and may have
    tie_embeddings   True when the output head shares the embedding's weight (refused under TP)
    moe              an MoE layer's args (num_experts, top_k): the model may use expert parallel

The model must have
    layers                       an nn.ModuleDict of blocks keyed "0", "1", ...: FSDP, activation
                                 checkpointing and compile work block by block, and a pipeline
                                 stage keeps some keys (so parameter names never change)
    init_weights(buffer_device)  initialise every parameter and buffer in place (after to_empty);
                                 Kiln calls it on one full, seeded copy to get layout-free weights
    init_buffers(device)         recompute the non-persistent buffers (e.g. a RoPE table)
    forward(tokens)              tokens [batch, seq] → logits [batch, seq, vocab]; on a pipeline
                                 stage hidden states come in and/or go out instead
and may have these ends, each None on a pipeline stage that does not own it (forward skips them):
    tok_embeddings               the first stage's module (all that runs before the blocks)
    norm, output                 the last stage's final norm and output head
FSDP shards each end as a group of its own; the default TP plan for the ends
(parallelisms.tensor_parallel.transformer_top_plan) splits the embedding by vocabulary rows and
the head by vocabulary columns, and loss parallel needs the head's logits sharded over the
vocabulary (Shard(-1)). A model without sequence parallel brings its own top plan.

Hooks a feature uses; a feature whose hook is missing is refused with a message naming it:
    rope_positions   model attribute, None or the sequence positions of this rank's tokens:
                     context parallel sets it (positions of its head-tail share)
    core_attention   attribute of each attention module, (q, k, v) → out over [batch, heads,
                     seq, head_dim]: context parallel replaces it with attention across ranks
    document_bos_id, restart_positions   model attributes read by training.document_mask: a BOS
                     token starts a document; attention stays inside documents
MoE layers (models/common/moe.py) carry their own: a `tokens_per_expert` buffer and
`update_expert_bias(counts)` (the trainer moves the expert bias), `aux_loss_scale` (set each step),
`dispatch` (expert parallel replaces it) and `partial_grad_sync` (tensor parallel sets it).

A family opts into pipeline parallel with ModelSpec.pipeline_fn (parallelisms.pipeline.make_stage_model
cuts any model that follows this contract), and may add layout checks of its own with
ModelSpec.check_fn(args, dims) → problems.
"""

from typing import Any, Protocol

import torch
from torch import nn

from components.errors import KilnError

ARGS_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "max_seq_len")
MODEL_METHODS = ("init_weights", "init_buffers")


class ModelContractError(KilnError):
    """A registered model (or its args) lacks part of the contract; the message names what."""


class KilnModel(Protocol):
    """The attributes a model must have (see the module docstring for the optional ones)."""

    layers: nn.ModuleDict

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None: ...

    def init_buffers(self, device: torch.device | str | None = None) -> None: ...

    def forward(self, tokens: torch.Tensor) -> torch.Tensor: ...


def args_problems(args: Any) -> list[str]:
    """What a flavor's args lack of the fields the trainer reads."""
    return [f"its args ({type(args).__name__}) have no field `{name}`"
            for name in ARGS_FIELDS if not hasattr(args, name)]


def model_problems(model: nn.Module) -> list[str]:
    """What a built model lacks of the contract."""
    out = [f"the model has no method `{name}`" for name in MODEL_METHODS
           if not callable(getattr(model, name, None))]
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        out.append(f"`model.layers` must be an nn.ModuleDict of blocks, not {type(layers).__name__}")
    elif not all(key.isdigit() for key in layers):
        out.append("the keys of `model.layers` must be block indices ('0', '1', ...)")
    return out


def check_contract(name: str, flavors: dict[str, Any], model_cls: Any) -> None:
    """Raise ModelContractError naming every part of the contract that model `name` lacks: the args
    of every flavor are checked, and the model is built on the meta device from the smallest."""
    problems = [f"flavor {flavor!r}: {p}" for flavor, args in flavors.items() for p in args_problems(args)]
    if not problems and flavors:
        smallest = min(flavors.values(), key=lambda a: a.n_layers * a.dim)
        with torch.device("meta"):
            problems = model_problems(model_cls(smallest))
    if problems:
        raise ModelContractError(f"model {name!r} does not meet the model contract (models/protocol.py): "
                                 + "; ".join(problems))
