"""Llama 3 family: registers the ModelSpec "llama3"."""

from models import ModelSpec, register_model_spec
from models.llama3.flavors import LLAMA3_FLAVORS
from models.llama3.hf_config import llama_args_from_hf
from models.llama3.model import Transformer, llama_flops_per_token
from models.llama3.parallelize import check_llama, parallelize_llama
from models.llama3.state_dict_adapter import LlamaStateDictAdapter
from parallelisms.pipeline import make_stage_model

register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=LLAMA3_FLAVORS,
        model_cls=Transformer,
        parallelize_fn=parallelize_llama,
        flops_per_token_fn=llama_flops_per_token,
        pipeline_fn=make_stage_model,
        state_dict_adapter=LlamaStateDictAdapter,
        hf_model_types=("llama",),
        args_from_hf=llama_args_from_hf,
        check_fn=check_llama,
    )
)
