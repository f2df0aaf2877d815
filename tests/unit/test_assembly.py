"""training/assembly.py is the one assembly of the trainer and the planner: the planner's optimizers
(over local copies of the parameters) get exactly the trainer's parameter groups, and both steps are
built by the same function."""

import logging
import warnings

import pytest


def build_both(extra: list[str]):
    """The trainer's optimizers and the planner's (LocalOptimizer) over the same tiny model part."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    from components.config.loading import load_config
    from components.config.parallel_options import ParallelOptions
    from planning.fake_world import fake_world
    from planning.rank_plan import LocalOptimizer
    from training.assembly import build_layout, build_model_parts, build_optimizers, load_model_family

    cfg = load_config(["--config", "llama_debug", "--model.flavor", "tiny", *extra])
    spec, args = load_model_family(cfg)
    options = ParallelOptions.from_config(cfg, "cpu")
    dims, _ = build_layout(cfg, spec, args, 1, options, "cpu")
    with fake_world(1, 0):
        dims.build_mesh("cpu")
        model = build_model_parts(spec, args, dims, options)
        model.parts[0].to_empty(device="cpu")
        trainer, _ = build_optimizers(cfg, model, "cpu")
        planner, schedulers = build_optimizers(cfg, model, "cpu", wrap=LocalOptimizer)
        dims.release()
    return model, trainer, [opt.inner for opt in planner], schedulers


def groups(optimizer) -> list[tuple[float, list[tuple[int, ...]]]]:
    return [(g["weight_decay"], [tuple(p.shape) for p in g["params"]]) for g in optimizer.param_groups]


@pytest.mark.parametrize("exclude", ["norms,biases", "norms,biases,embeddings"])
def test_planner_optimizers_have_the_trainers_groups(exclude):
    """Weight decay off for the excluded kinds in both (the planner once named parameters by their
    index and lost `exclude` and `embeddings`)."""
    model, trainer, planner, schedulers = build_both(["--optimizer.weight_decay", "0.1",
                                                      "--optimizer.weight_decay_exclude", exclude])
    assert groups(planner[0]) == groups(trainer[0])
    decays = {wd for wd, _ in groups(trainer[0])}
    assert decays == {0.0, 0.1}
    no_decay = [shapes for wd, shapes in groups(trainer[0]) if wd == 0.0][0]
    embedding = tuple(model.parts[0].tok_embeddings.weight.shape)
    assert (embedding in no_decay) == ("embeddings" in exclude)
    assert schedulers[0].optimizer is planner[0]
