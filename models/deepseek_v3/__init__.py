"""DeepSeek-V2/V3 family: registers the ModelSpec "deepseek_v3" (multi-head latent attention, dense
then MoE blocks with shared experts and group-limited routing, YaRN RoPE)."""

from models import ModelSpec, register_model_spec
from models.deepseek_v3.flavors import DEEPSEEK_V3_FLAVORS
from models.deepseek_v3.model import DeepSeekV3Transformer, deepseek_v3_flops_per_token
from models.deepseek_v3.parallelize import check_deepseek_v3, parallelize_deepseek_v3
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter, args_from_hf
from parallelisms.pipeline import make_stage_model

register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        flavors=DEEPSEEK_V3_FLAVORS,
        model_cls=DeepSeekV3Transformer,
        parallelize_fn=parallelize_deepseek_v3,
        flops_per_token_fn=deepseek_v3_flops_per_token,
        pipeline_fn=make_stage_model,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        check_fn=check_deepseek_v3,
        hf_model_types=("deepseek_v3",),
        args_from_hf=args_from_hf,
    )
)
