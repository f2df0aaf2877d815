"""Mixture-of-Experts family: registers the ModelSpec "moe" (Llama attention, MoE feed-forward)."""

from models import ModelSpec, register_model_spec
from models.moe.flavors import MOE_FLAVORS
from models.moe.hf_config import mixtral_args_from_hf
from models.moe.model import MoETransformer, moe_flops_per_token
from models.moe.parallelize import check_moe, parallelize_moe
from models.moe.state_dict_adapter import MixtralStateDictAdapter
from parallelisms.pipeline import make_stage_model

register_model_spec(
    ModelSpec(
        name="moe",
        flavors=MOE_FLAVORS,
        model_cls=MoETransformer,
        parallelize_fn=parallelize_moe,
        flops_per_token_fn=moe_flops_per_token,
        pipeline_fn=make_stage_model,
        state_dict_adapter=MixtralStateDictAdapter,
        hf_model_types=("mixtral",),
        args_from_hf=mixtral_args_from_hf,
        check_fn=check_moe,
    )
)
