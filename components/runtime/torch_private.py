"""Every private (underscored) torch API Kiln's product code uses, with where and why.

Private APIs can change or vanish in any torch release: this is the list to walk when torch is
upgraded, and tests/unit/test_torch_private.py fails when an entry no longer resolves on the
installed torch or when product code uses one that is not listed here. The tested torch range and
the version workarounds: docs/compatibility.md.
"""

import importlib
import inspect
import re
from typing import Any

_SDPA_OPS = ("parallelisms/activation_checkpoint.py: outputs selective AC keeps; "
             "parallelisms/attention_kernels.py: context parallel's chunk-pair forward; "
             "planning/cuda_attention.py: a CUDA plan's attention where the CPU has no fused kernel")


_CP_BACKWARD = "parallelisms/attention_kernels.py: context parallel's chunk-pair backward"


_FAKE_COLLECTIVES = "planning/step_tracker.py: the collectives a fake step issues and their bytes"


# Dotted path -> where Kiln uses it and why. A path may end in a class's method or an attribute
# its instances carry (DTensor._local_tensor); operators are listed without their overload.
PRIVATE_APIS: dict[str, str] = {
    # models/
    "torch._grouped_mm": "models/common/moe.py: the experts' grouped GEMM on CUDA bf16 (no public op)",
    "torch._C._current_graph_task_id": "models/common/moe.py: -1 outside backward, so expert load is "
                                       "not counted again when activation checkpointing re-runs forward",
    # components/
    "torch._disable_dynamo":
        "components/runtime/tensor_utils.py: torch.compiler.disable that imports dynamo lazily",
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._lazy_init": "planning/rank_plan.py: "
        "FSDP's first-forward init run before the planner's optimizer exists (fake storages' data_ptr "
        "is 0, so a later one would pad uneven shards a second time inside the measured step)",
    "torch._dynamo.utils.counters":
        "components/observability/run_summary.py: how many graphs torch.compile produced "
        "(counters['stats']['unique_graphs']), said at the end of a run",
    "torch._foreach_norm": "components/optim/grad_norm.py: one fused norm kernel per gradient group on GPU",
    "torch.cuda.memory._record_memory_history":
        "components/observability/profiling.py: CUDA allocator history for "
        "memory snapshots",
    "torch.cuda.memory._dump_snapshot":
        "components/observability/profiling.py: writes the memory snapshot pickle",
    "torch._C._profiler._EventType":
        "components/observability/memory_report.py: tells allocator events apart",
    "torch._C._profiler._EventType.Allocation":
        "components/observability/memory_report.py: the allocator event kind",
    "torch.utils._python_dispatch.TorchDispatchMode": "components/observability/memory_report.py and "
                                                      "planning/step_tracker.py: see every op a step runs",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass": "components/checkpoint/states.py: "
                                                                  "finds tensor subclasses in a state dict",
    "torch.distributed.checkpoint._traverse.set_element": "components/checkpoint/states.py: sets a nested "
                                                          "state-dict entry as DCP's planner does",
    "torch.optim.lr_scheduler.LRScheduler._step_count": "components/checkpoint/states.py: moves a "
                                                        "scheduler to a resumed step (no public way)",
    "torch.optim.lr_scheduler.LRScheduler._last_lr": "components/checkpoint/states.py: the learning rates "
                                                     "get_last_lr() reports after a resume",
    "torch.distributed._tools.fake_collectives.collective_ops":
        "components/observability/memory_report.py and "
        + _FAKE_COLLECTIVES,
    "torch.distributed._tools.fake_collectives.sync_ops": "components/observability/memory_report.py and "
                                                          + _FAKE_COLLECTIVES,
    # parallelisms/
    "torch._functorch.config": "parallelisms/compile.py: imported for enable_autograd_cache (nothing "
                               "earlier loads it)",
    "torch._functorch.config.enable_autograd_cache": "parallelisms/compile.py: off under TP (cached "
                                                     "graphs gave wrong gradients)",
    "torch._inductor.config._micro_pipeline_tp": "parallelisms/tensor_parallel.py: async TP",
    "torch.distributed._symmetric_memory.enable_symm_mem_for_group": "parallelisms/tensor_parallel.py: "
                                                                     "async TP's symmetric memory",
    "torch.distributed._functional_collectives.all_gather_single_autograd": "parallelisms/context_parallel"
                                                                           ".py: K/V gather with a backward",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper":
        "parallelisms/activation_checkpoint.py and benchmarks/reference_loop.py: activation checkpointing",
    "torch.ops.aten._scaled_dot_product_flash_attention": _SDPA_OPS,
    "torch.ops.aten._scaled_dot_product_efficient_attention": _SDPA_OPS,
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": _SDPA_OPS,
    "torch.ops.aten._scaled_dot_product_flash_attention_backward": _CP_BACKWARD,
    "torch.ops.aten._scaled_dot_product_efficient_attention_backward": _CP_BACKWARD,
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": _CP_BACKWARD,
    "torch.distributed.device_mesh.DeviceMesh._flatten": "parallelisms/parallel_dims.py: the combined "
                                                         "dp/cp/ep mesh views",
    "torch.distributed.device_mesh.DeviceMesh._unflatten": "parallelisms/parallel_dims.py: HSDP's "
                                                           "replicate x shard view",
    "torch.distributed.fsdp.FSDPModule._set_unshard_async_op": "parallelisms/gloo_accelerations.py: "
                                                               "async unshards (no public switch)",
    "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather": "parallelisms/gloo_accelerations.py: "
                                                               "base of FSDP2's custom all-gather",
    "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter": "parallelisms/gloo_accelerations.py: "
                                                                   "base of FSDP2's custom reduce-scatter",
    "torch.distributed.pipelining.PipelineStage._post_metadata_inference_cleanup":
        "parallelisms/pipeline.py: the hook point right after a stage's shape inference",
    "torch.nn.Module._parameters": "parallelisms/materialize.py and planning/rank_plan.py: swap "
                                   "parameters in place (tied weights stay one object)",
    "torch.nn.Module._buffers": "planning/rank_plan.py: swap buffers for fake tensors in place",
    # planning/
    "torch._subclasses.fake_tensor.FakeTensorMode": "planning/rank_plan.py and planning/step_tracker.py: "
                                                    "run a rank's step without memory",
    "torch._guards.active_fake_mode": "planning/step_tracker.py: counts only the plan's own fake tensors",
    "torch._ops.OpOverload": "planning/step_tracker.py: the type of the ops dispatch hands over",
    "torch._ops.OpOverload._schema": "planning/step_tracker.py: an op's argument names",
    "torch.ops._c10d_functional.wait_tensor": "planning/step_tracker.py: eager waits happen in place",
    "torch.distributed.tensor.DTensor._local_tensor": "planning/step_tracker.py: a DTensor's own storage",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator": "planning/step_tracker.py: see below",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached":
        "planning/step_tracker.py: DTensor's shape propagation is not the rank's memory",
    "torch.distributed._tools.fake_collectives.CollectiveOp": _FAKE_COLLECTIVES,
    "torch.distributed._tools.fake_collectives.CollectiveOp.get_comm_tensor_size": _FAKE_COLLECTIVES,
    "torch.distributed._tools.fake_collectives.CollectiveOp.get_process_group": _FAKE_COLLECTIVES,
    "torch.distributed._tools.fake_collectives.CollectiveOp.sum_tensors": _FAKE_COLLECTIVES,
    "torch.utils._pytree.tree_flatten": "planning/step_tracker.py: the tensors in an op's output; "
                                        "components/fault_tolerance/heal_state.py: a state's tensors",
    "torch.utils._pytree.tree_map": "components/fault_tolerance/heal_state.py: a state sent as local shards",
    "torch.utils._pytree.tree_unflatten": "components/fault_tolerance/heal_state.py: a received state "
                                          "rebuilt like this group's own",
    "torch.testing._internal.distributed.fake_pg": "planning/fake_world.py: registers the fake backend",
    "torch._C._distributed_c10d.FakeStore": "planning/fake_world.py: the fake world's store",
    "torch.distributed.pipelining.schedules.Schedule1F1B._n_microbatches": "planning/pipeline_bubble.py: "
                                                                           "1F1B's bubble from its size",
    # scripts/
    "torch.distributed.elastic.multiprocessing.api._terminate_process_handler": "scripts/launch.py: pass "
                                                                                "a stop signal to workers",
}


def resolve(path: str) -> Any:
    """The object at a dotted torch path, importing modules on the way; raises LookupError if gone."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=1):
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif inspect.ismodule(obj) and _importable(".".join(parts[:i + 1])):
            obj = importlib.import_module(".".join(parts[:i + 1]))
        elif inspect.isclass(obj) and i == len(parts) - 1 and _instance_attribute(obj, name):
            return obj  # set per instance: its class declares or assigns it
        else:
            raise LookupError(f"{path}: {'.'.join(parts[:i])} has no {name}")
    return obj


def missing(apis: dict[str, str] = PRIVATE_APIS) -> list[str]:
    """The listed paths that no longer resolve on the installed torch."""
    gone = []
    for path in apis:
        try:
            resolve(path)
        except LookupError:
            gone.append(path)
    return gone


def _importable(module: str) -> bool:
    """Whether `module` imports (a submodule that its package does not import itself)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _instance_attribute(cls: type, name: str) -> bool:
    """Whether cls or a base annotates `name` or assigns `self.name` in its source."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a class built in C or without source
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=]*)?=", source):
            return True
    return False
