"""Qwen3 family, dense and MoE: registers the ModelSpec "qwen3".

One family rather than two (`qwen3`, `qwen3_moe`), as in TorchTitan: the blocks differ only in the
layer after the second norm, and a flavor with `moe` args builds MoE blocks. Both of Hugging
Face's model types (qwen3, qwen3_moe) read into it.
"""

from models import ModelSpec, register_model_spec
from models.qwen3.flavors import QWEN3_FLAVORS
from models.qwen3.model import Qwen3Transformer, qwen3_flops_per_token
from models.qwen3.parallelize import check_qwen3, parallelize_qwen3
from models.qwen3.state_dict_adapter import MODEL_TYPES, Qwen3StateDictAdapter, args_from_hf
from parallelisms.pipeline import make_stage_model

register_model_spec(
    ModelSpec(
        name="qwen3",
        flavors=QWEN3_FLAVORS,
        model_cls=Qwen3Transformer,
        parallelize_fn=parallelize_qwen3,
        flops_per_token_fn=qwen3_flops_per_token,
        pipeline_fn=make_stage_model,
        state_dict_adapter=Qwen3StateDictAdapter,
        check_fn=check_qwen3,
        hf_model_types=MODEL_TYPES,
        args_from_hf=args_from_hf,
    )
)
