"""scripts/plan.py --search as a user runs it: the layouts of a world ranked by the step-time model,
each sized from fake plans cut to one and two blocks per stage; the best one's numbers equal a
full plan of it (the scaling to the model's depth and rows is exact where the step is linear)."""

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO

# Five blocks: the search plans one and two per stage and scales to 5 (2.5 per stage under PP 2).
MODEL = ["--config", "llama_debug", "--model.flavor", "tiny", "--job.custom_import",
         "tests.helpers.variant_models", "--model.name", "llama3_5l", "--training.seq_len", "128",
         "--training.global_batch_size", "8"]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/plan.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_search_ranks_the_layouts_its_best_equal_full_plans_and_a_short_search_finds_the_same():
    proc = plan("--search", "--json", "--world-size", "2", "--top", "50", *MODEL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    ranked = result["ranked"]
    assert result["planned"] > 0 and len(ranked) >= 6
    speeds = [r["tokens_per_second_per_device"] for r in ranked]
    assert speeds == sorted(speeds, reverse=True)
    kinds = {(r["degrees"]["tp"], r["degrees"]["pp"]) for r in ranked}
    assert {(1, 1), (2, 1), (1, 2)} <= kinds  # FSDP 2, TP 2 and PP 2 are all among them
    assert {r["ac_mode"] for r in ranked} == {"none", "selective", "full"}
    # the best layout, and the best of another kind (pipeline or not): scaled = planned in full
    other = [r for r in ranked if (r["degrees"]["pp"] == 1) != (ranked[0]["degrees"]["pp"] == 1)][:1]
    for row in ranked[:1] + other:
        flags = [f"--{k}={v}" for k, v in row["flags"].items()]
        # the printed flags alone set the rows: a config's local batch (3 divides no batch of 8) is replaced
        full = plan("--json", "--no-ac-modes", "--world-size", "2", *MODEL, "--training.local_batch_size=3",
                    *flags)
        assert full.returncode == 0, full.stderr[-3000:]
        whole = json.loads(full.stdout)
        peak = max(r["peak"] for r in whole["ranks"]) / 2**30
        assert abs(peak - row["peak_gib"]) <= 0.02 * peak + 1e-3, (row["layout"], peak, row["peak_gib"])
        assert abs(whole["step_seconds"] - row["step_seconds"]) <= 0.02 * whole["step_seconds"], row["layout"]
    # On a device that holds about a quarter of them, the best three that fit — found by planning the
    # leaders' peaks only, skipping more rows where fewer were too big — are the first three of all
    # those whose peak fits.
    peaks = sorted({r["peak_gib"] for r in ranked})  # rounded to 1/1000 GiB: capacity between two
    middles = [(a + b) / 2 for a, b in zip(peaks, peaks[1:], strict=False)]
    capacity = min(middles, key=lambda m: abs(m - peaks[len(peaks) // 4]))  # the fastest do not fit
    proc = plan("--search", "--json", "--world-size", "2", "--top", "3", "--device-memory", f"{capacity}GiB",
                "--reserve-gib", "0", *MODEL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    leaders = json.loads(proc.stdout)
    expected = [r for r in ranked if r["peak_gib"] < capacity][:3]
    assert [r["layout"] for r in leaders["ranked"]] == [r["layout"] for r in expected]
    assert [r["peak_gib"] for r in leaders["ranked"]] == [r["peak_gib"] for r in expected]
    assert leaders["planned"] < result["planned"] and leaders["too_big_by_rows"] > 0


def test_layouts_that_could_not_beat_the_ranked_are_never_timed_and_the_ranking_is_the_same():
    """Branch and bound: where compute dominates (a slow device), the layouts whose best possible
    speed — their compute and bubble alone — is below the two ranked are never timed; timing every
    layout (a --top no world reaches) ranks the same two first, with the same numbers."""
    device = ["--world-size", "2", "--device", "cpu", "--device-memory", "8GiB", "--peak-tflops", "0.0005"]
    results = []
    for top in ("2", "100"):
        proc = plan("--search", "--json", "--top", top, *device, *MODEL)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout))
    short, every = results
    assert every["untimed"] == 0 and short["untimed"] > 0 and short["planned"] < every["planned"]
    assert short["distinct"] == every["distinct"]
    assert len(short["ranked"]) == 2 and short["ranked"] == every["ranked"][:2]


@pytest.mark.parametrize("schedule,timed_with", [("1F1B", "GPipe"), ("Interleaved1F1B", "LoopedBFS")])
def test_a_pipeline_is_timed_with_a_schedule_that_sends_what_its_own_does(schedule, timed_with):
    """The search times a pipeline's collectives with GPipe or LoopedBFS (any count of microbatches):
    at a full pipeline (4 microbatches), each rank's bytes and calls equal its own schedule's."""
    plans = []
    for name in (schedule, timed_with):
        proc = plan("--json", "--no-ac-modes", "--world-size", "2", *MODEL, "--training.global_batch_size=4",
                    "--training.local_batch_size=1", "--parallelism.pipeline_parallel_degree=2",
                    "--parallelism.pipeline_parallel_microbatch_size=1",
                    f"--parallelism.pipeline_parallel_schedule={name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans.append(json.loads(proc.stdout)["ranks"])
    own, timed = plans
    assert [r["rank"] for r in own] == [r["rank"] for r in timed] == [0, 1]
    for a, b in zip(own, timed, strict=True):
        assert a["communication"]["pp"]["send/recv"] > 0 and a["calls"] == b["calls"]
        assert a["communication"] == b["communication"]


def test_search_prints_the_fastest_and_how_to_run_it():
    proc = plan("--search", "--world-size", "1", "--top", "3", *MODEL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Search · llama3_5l/tiny · world 1 · H100 SXM 80GB" in proc.stdout
    assert "tokens/s/dev" in proc.stdout and "run the first with: --parallelism." in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line[:3].strip().isdigit()]) == 3


def test_search_where_nothing_fits_shows_the_smallest_without_planning_what_cannot_fit():
    # 1 MiB per device: the state alone exceeds it, so nothing is planned beyond the plans that time
    # every layout (one rank × one and two blocks at two microbatches, no AC)
    proc = plan("--search", "--json", "--world-size", "1", "--device-memory", "1MiB", "--reserve-gib", "0",
                *MODEL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["ranked"] == [] and result["checked"] == 0 and result["planned"] == 2
    smallest = result["too_big"]
    assert smallest and all(r["peak_is_lower_bound"] and r["peak_gib"] > 1 / 1024 for r in smallest)
    text = plan("--search", "--world-size", "1", "--device-memory", "1MiB", "--reserve-gib", "0", *MODEL)
    assert "nothing fits: the smallest peaks were" in text.stdout and "≥" in text.stdout


def test_search_needs_a_global_batch():
    proc = plan("--search", "--world-size", "2", "--config", "llama_debug", "--training.global_batch_size=-1")
    assert proc.returncode == 2
    assert ("kiln: error: plan.py --search keeps the global batch: give --training.global_batch_size"
            in proc.stderr)


MOE_PP_EP = ["--config", "llama_debug", "--model.name", "moe", "--training.seq_len", "64",
             "--training.global_batch_size", "8", "--parallelism.expert_parallel_degree", "2"]


@pytest.mark.parametrize("world,args,schedule", [
    (2, MODEL, "1F1B"), (2, MODEL, "Interleaved1F1B"), (4, MOE_PP_EP, "Interleaved1F1B")])
def test_a_block_adds_the_same_on_the_last_stage_as_on_the_first(world, args, schedule):
    """The search times the last stage's rank at one block per stage only and grows it by what a block
    adds to the first stage's: that equals its own plan at two blocks (the output layer and loss stay
    its own), in state and in every collective."""
    from components.config.loading import load_config
    from planning.depth_scaling import at_blocks
    from planning.search import _piece, _plan
    from training.assembly import load_model_family

    cfg = load_config(args)
    spec, model_args = load_model_family(cfg)
    flags = {"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": schedule,
             "parallelism.data_parallel_shard_degree": -1, "parallelism.data_parallel_replicate_degree": 1}
    piece = _piece(cfg, flags, world, spec, model_args, "cuda")
    first, last = piece.ranks
    keys = [piece.plan_key((rank, "none", k, 1, m), True) for rank in (first, last) for k in (1, 2)
            for m in piece.timing_microbatches]
    _plan([(piece, key) for key in keys], 2)
    assert not piece.errors, piece.errors
    for m in piece.timing_microbatches:
        plans = {(rank, k): piece.results[piece.plan_key((rank, "none", k, 1, m), True)]
                 for rank in (first, last) for k in (1, 2)}
        assert plans[(last, 1)].parameters != plans[(first, 1)].parameters  # the ends differ
        own = at_blocks(plans[(last, 1)], plans[(last, 2)], 3)
        grown = at_blocks(plans[(first, 1)], plans[(first, 2)], 3, plans[(last, 1)])
        for field in ("parameters", "gradients", "optimizer", "buffers", "communication", "calls"):
            assert getattr(grown, field) == getattr(own, field), (m, field)


def test_a_pipelines_lower_bound_on_its_peak_holds_and_counts_its_forwards_in_flight(monkeypatch):
    """The search skips a layout whose peak has a lower bound above the device. Under a pipeline
    that bound is what the first rank holds as its first two backwards begin (the first: at its
    most), in short plans, with the forwards the layout's schedule has in flight then, each holding
    what a forward keeps in the layout's AC mode (selective AC's, before its own plans, at least
    what its unchecked blocks keep without AC): it is above the state alone, and below the peak
    planned with the layout's own schedule (here; scaled to a deeper model's stages that peak can
    fall below the bound, and the search takes the bound)."""
    import planning.search as search_module
    from components.config.loading import load_config
    from planning.depth_scaling import state_floor
    from planning.devices import DEVICES
    from planning.layout_bounds import least_in_flight_peak

    checked = []
    check = search_module._check_fastest

    def noted(sized, *args):
        checked.extend(sized)
        return check(sized, *args)

    monkeypatch.setattr(search_module, "_check_fastest", noted)
    cfg = load_config([*MODEL, "--training.global_batch_size", "16"])
    search_module.search(cfg, 2, DEVICES["h100"], top=100)  # every layout checked
    bounded = [s for s in checked if s.piece.dims.pp > 1]
    assert {(s.piece.stages, s.layout.ac_mode) for s in bounded} == {  # 1F1B and Interleaved1F1B
        (stages, mode) for stages in (1, 2) for mode in ("none", "selective", "full")}
    above = set()
    for s in bounded:
        state = max(state_floor(plan, s.replicas) for plan in s.states.values())
        planned = s.peak(s.layout.rows)
        assert s._floor is not None  # its forwards were counted
        assert state <= s.floor <= planned == s.layout.peak, (s.layout.describe(), state, s.floor, planned)
        if s.layout.ac_mode == "selective":  # every second block: the other keeps what it keeps without AC
            assert 0 < s._selective_floor_from_none() <= planned, s.layout.describe()
        if s.floor > state:
            above.add((s.piece.stages, s.layout.ac_mode))
        # the timing schedule runs both microbatches' forwards on each local stage before a backward
        in_flight = 2 * s.piece.stages
        for key in s.piece.keeps_keys(s.layout.ac_mode):
            starts = s.piece.results[key].backward_starts
            assert [n for _, n, _ in starts] == [in_flight, in_flight - 1]
            assert all(alive < most for alive, _, most in starts)  # a backward makes gradients
    assert above == {(stages, mode) for stages in (1, 2) for mode in ("none", "selective", "full")}, above
    # before a layout is timed, what its forwards in flight keep (learned from the others' plans)
    # bounds its peak too: in every mode — selective AC's from its unchecked blocks without AC
    keeps: dict = {}
    search_module._learn_keeps(list({id(s.piece): s.piece for s in checked}.values()), keeps)
    for s in checked:
        known = keeps[search_module._keeps_key(s.piece)]
        assert set(known) == {"none", "selective", "full"}
        least = least_in_flight_peak(s.piece, s.replicas, s.layout.ac_mode, known)
        assert least_in_flight_peak(s.piece, s.replicas, s.layout.ac_mode, {}) < least <= s.layout.peak, (
            s.layout.describe(), least, s.layout.peak)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_a_pipelined_peak_grows_past_its_planned_microbatches_by_what_each_keeps_to_the_end(schedule):
    """Torch's pipeline stages make a receive buffer for every microbatch of a step (activations in,
    gradients back) and keep them to its end, beside the step's rows: past the microbatches its peak
    is planned at (1F1B: pp + 1, its first rank's steady state; Interleaved1F1B: a round more than
    pp × stages, whose steady state holds a buffer more on the first rank), a pipelined peak grows by
    them. The search's peak of each planned rank at a step of 16 microbatches, of one row and of two,
    equals a plan of that step, and exceeds the planned count's peak by at least those buffers. Under
    FSDP 2, whose
    gathers an interleaved schedule makes before its first forward: they are no microbatch's."""
    from components.config.loading import load_config
    from planning.depth_scaling import rank_peak
    from planning.search import _piece, _plan
    from training.assembly import load_model_family

    cfg = load_config([*MODEL, "--training.global_batch_size", "32"])
    spec, model_args = load_model_family(cfg)
    flags = {"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": schedule,
             "parallelism.data_parallel_shard_degree": -1, "parallelism.data_parallel_replicate_degree": 1}
    piece = _piece(cfg, flags, 4, spec, model_args, "cuda")
    assert piece.dims.dp_shard == 2
    assert piece.per_rank == 16 and max(piece.peak_microbatches.values()) < 16
    scaled_keys = [piece.plan_key(key, False) for key in
                   [(rank, "full", k, rows, m) for rank in piece.ranks for k in (1, 2)
                    for rows, m in piece.peak_microbatches.items()]]
    direct_keys = [piece.plan_key((rank, "full", 1, rows, 16 // rows), False) for rank in piece.ranks
                   for rows in piece.peak_microbatches]
    _plan([(piece, key) for key in scaled_keys + direct_keys], 2)
    assert not piece.errors, piece.errors
    for rank in piece.ranks:
        for rows, count in piece.peak_microbatches.items():
            planned = piece.results[piece.plan_key((rank, "full", 1, rows, count), False)]
            direct = piece.results[piece.plan_key((rank, "full", 1, rows, 16 // rows), False)]
            scaled = rank_peak(piece.lookup(False), direct, rank, "full", (1, 2), piece.peak_microbatches, 1,
                               rows, 1, False, 16 // rows)
            kept = direct.microbatch_bytes
            assert kept > 0 and direct.peak - planned.peak >= kept * (16 // rows - count) - 64
            # to a few bytes (a step's scalars)
            assert abs(direct.peak - scaled) <= 64, (rank, rows, direct.peak, scaled, kept)


def test_a_middle_pipeline_rank_is_planned_at_its_fewest_blocks_and_grown_as_the_first():
    """A middle pipeline rank holds receive buffers both ways and neither the embedding nor the head:
    the search plans its peak at the fewest blocks and grows it by what a block adds to the first
    rank's, which holds one forward more in flight. At two blocks that is at least the middle rank's
    own plan, and at most one forward's keeps of a block more; at a step of 16 microbatches, its own
    plan of that step to a few bytes, with more kept per microbatch than the first rank."""
    from components.config.loading import load_config
    from planning.depth_scaling import rank_peak
    from planning.search import _piece, _plan
    from training.assembly import load_model_family

    cfg = load_config([*MODEL, "--training.global_batch_size", "16"])
    spec, model_args = load_model_family(cfg)
    flags = {"parallelism.pipeline_parallel_degree": 4, "parallelism.pipeline_parallel_schedule": "1F1B",
             "parallelism.data_parallel_shard_degree": -1, "parallelism.data_parallel_replicate_degree": 1}
    piece = _piece(cfg, flags, 4, spec, model_args, "cuda")
    first, middle, planned = piece.ranks[0], piece.middle, piece.peak_microbatches[1]
    assert middle == 1 and piece.peak_ranks() == [0, 3, 1]
    keys = [(rank, "full", k, 1, m) for rank in (first, middle) for k in (1, 2) for m in (planned, 16)]
    _plan([(piece, piece.plan_key(key, False)) for key in keys], 2)
    assert not piece.errors, piece.errors
    plan = {key: piece.results[piece.plan_key(key, False)] for key in keys}

    def grown(blocks: int, microbatches: int) -> int:
        return rank_peak(piece.lookup(False), plan[(first, "full", 1, 1, planned)], first, "full", (1, 2),
                         piece.peak_microbatches, blocks, 1, 1, False, microbatches, own=middle)

    one, two = (plan[(first, "full", k, 1, planned)].forward_keeps for k in (1, 2))
    block_keeps = two - one
    assert block_keeps > 0
    assert 0 <= grown(2, planned) - plan[(middle, "full", 2, 1, planned)].peak <= block_keeps + 64
    assert abs(grown(1, 16) - plan[(middle, "full", 1, 1, 16)].peak) <= 64
    kept = {rank: plan[(rank, "full", 1, 1, 16)].microbatch_bytes for rank in (first, middle)}
    assert kept[middle] > kept[first] > 0, kept


@pytest.mark.parametrize("schedule,pp", [("1F1B", 6), ("Interleaved1F1B", 5)])
def test_a_deep_pipelines_peaks_planned_at_a_shallower_one_equal_its_own(schedule, pp):
    """A deep pipeline's peak plans run at four stages over the same other degrees and grow by the
    forwards more in flight, stage by stage, and the microbatches more (planning/shallow_pipeline.py):
    each planned rank's (the first, a middle and the last), at one row and at two per microbatch,
    equals the deep pipeline's own plan to a few bytes — and differs from the shallow plan as run."""
    import copy

    from components.config.loading import load_config
    from planning.search import _piece, _plan
    from training.assembly import load_model_family

    cfg = load_config([*MODEL, "--model.name", "llama3_10l", "--training.global_batch_size", "64"])
    spec, model_args = load_model_family(cfg)
    flags = {"parallelism.pipeline_parallel_degree": pp, "parallelism.pipeline_parallel_schedule": schedule,
             "parallelism.data_parallel_shard_degree": -1, "parallelism.data_parallel_replicate_degree": 1}
    piece = _piece(cfg, flags, 2 * pp, spec, model_args, "cuda")
    assert piece.shallow is not None and piece.shallow.degree == 4 and piece.shallow_rows == (1, 2)
    deep, as_run = copy.copy(piece), copy.copy(piece)
    deep.shallow = None
    as_run.finished = lambda key, plan: plan  # the shallow plan itself
    for p in (deep, as_run):
        p.results, p.errors = {}, {}
    keys = [piece.plan_key((rank, "full", 1, rows, piece.peak_microbatches[rows]), False)
            for rank in piece.peak_ranks() for rows in (1, 2)]
    _plan([(p, key) for p in (piece, deep, as_run) for key in keys], 2)
    assert not piece.errors and not deep.errors and not as_run.errors, (piece.errors, deep.errors)
    for key in keys:
        grown, own, shallow = piece.results[key], deep.results[key], as_run.results[key]
        assert abs(grown.peak - own.peak) <= 64, (key, grown.peak, own.peak)
        assert abs(grown.last_backward_peak - own.last_backward_peak) <= 64, key
        assert (grown.rank, grown.coordinates, grown.stages) == (own.rank, own.coordinates, own.stages)
        assert own.peak - shallow.peak > 64, key  # the deep pipeline's keeps more


MOE = ["--config", "llama_debug", "--model.name", "moe", "--training.seq_len", "64",
       "--training.global_batch_size", "8"]


def test_a_steps_collectives_are_linear_from_its_first_microbatch():
    """The search times a layout without a pipeline at two microbatches per step and scales its
    collectives linearly: one microbatch fewer sends what the first of them did less (a step of one,
    whose microbatch is also the last, is such a step), and the difference from 2 to 3 equals that
    from 1 to 2, in bytes and calls."""
    from components.config.loading import load_config
    from planning.depth_scaling import one_microbatch_fewer
    from planning.search import _piece, _plan
    from training.assembly import load_model_family

    layouts = [(MODEL, {}), (MODEL, {"parallelism.tensor_parallel_degree": 2}),
               (MODEL, {"parallelism.data_parallel_replicate_degree": 2}),
               (MODEL, {"parallelism.context_parallel_degree": 2}),
               (MOE, {"parallelism.expert_parallel_degree": 2, "parallelism.tensor_parallel_degree": 2}),
               (MOE, {"parallelism.tensor_parallel_degree": 4})]
    jobs = []
    for args, flags in layouts:
        cfg = load_config(args)
        spec, model_args = load_model_family(cfg)
        piece = _piece(cfg, {"parallelism.data_parallel_shard_degree": -1,
                             "parallelism.data_parallel_replicate_degree": 1} | flags, 4, spec, model_args,
                       "cuda")
        assert piece is not None and piece.timing_microbatches == (1, 2), flags
        jobs += [(piece, piece.plan_key((0, "none", 2, 1, m), True)) for m in (1, 2, 3)]
    _plan(jobs, 2)
    for i, (_, flags) in enumerate(layouts):
        piece = jobs[3 * i][0]
        assert not piece.errors, (flags, piece.errors)
        plans = [piece.results[key] for _, key in jobs[3 * i:3 * i + 3]]
        for field in ("communication", "calls"):
            tables = [getattr(p, field) for p in plans]
            entries = {(dim, kind) for t in tables for dim, kinds in t.items() for kind in kinds}
            assert entries, flags
            for dim, kind in entries:
                one, two, three = (t.get(dim, {}).get(kind, 0) for t in tables)
                assert three - two == two - one, (flags, field, dim, kind, one, two, three)
        # what the search times from: the plan at two microbatches and its first microbatch's own
        derived = one_microbatch_fewer(plans[1])
        for field in ("communication", "calls"):
            assert {dim: {kind: n for kind, n in kinds.items() if n} for dim, kinds in
                    getattr(derived, field).items()} == getattr(plans[0], field), (flags, field)
        assert piece.base() == [piece.plan_key((0, "none", k, 1, 2), True) for k in (1, 2)]


@pytest.mark.parametrize("args,flags", [
    (MODEL, {"parallelism.tensor_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "1F1B"}),
    (MODEL, {"parallelism.tensor_parallel_degree": 2,
             "parallelism.pipeline_parallel_schedule": "Interleaved1F1B"}),
    (MOE, {"parallelism.expert_parallel_degree": 2,
           "parallelism.pipeline_parallel_schedule": "Interleaved1F1B"})])
def test_a_pipeline_step_less_one_microbatch_is_the_step_of_one_fewer(args, flags):
    """A pipeline is timed at two microbatches (by GPipe or LoopedBFS); what one more microbatch adds
    (each stage's second forward and first backward that is not its last, the second loss and the
    sends) taken away gives the step of one, on the first stage's rank and the last's, in bytes and
    calls; and the step is linear in its microbatches (1, 2, 3)."""
    from components.config.loading import load_config
    from planning.depth_scaling import one_microbatch_fewer
    from planning.search import _piece, _plan
    from training.assembly import load_model_family

    cfg = load_config(args)
    spec, model_args = load_model_family(cfg)
    flags = flags | {"parallelism.pipeline_parallel_degree": 2, "parallelism.data_parallel_shard_degree": -1,
                     "parallelism.data_parallel_replicate_degree": 1}
    piece = _piece(cfg, flags, 4, spec, model_args, "cuda")
    assert piece.timing_counts == (2,) and piece.timing_schedule in ("GPipe", "LoopedBFS")
    keys = {(rank, m): piece.plan_key((rank, "none", 2, 1, m), True)
            for rank in piece.ranks for m in (1, 2, 3)}
    _plan([(piece, key) for key in keys.values()], 2)
    assert not piece.errors, piece.errors
    for rank in piece.ranks:
        plans = [piece.results[keys[(rank, m)]] for m in (1, 2, 3)]
        derived = one_microbatch_fewer(plans[1])
        for field in ("communication", "calls"):
            assert {dim: {kind: n for kind, n in kinds.items() if n} for dim, kinds in
                    getattr(derived, field).items()} == getattr(plans[0], field), (rank, field)
            tables = [getattr(p, field) for p in plans]
            for dim, kinds in tables[2].items():
                for kind, three in kinds.items():
                    one, two = (t.get(dim, {}).get(kind, 0) for t in tables[:2])
                    assert three - two == two - one, (rank, field, dim, kind, one, two, three)
        assert plans[1].microbatch_communication["pp"]["send/recv"] > 0
