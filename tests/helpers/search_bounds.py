"""Every layout of a search timed, none checked against memory, with what its piece's bounds said:
prints JSON, one row per timed layout — its piece's speed bound and least peak, its prediction,
planned state and (at one row: without AC, and under a pipeline in full AC) planned peak beside the least
layout_bounds.least_in_flight_peak gives it, and its first rank's planned bytes beside the
communication floors.

    python -m tests.helpers.search_bounds WORLD RANKS_PER_NODE [config arguments...]

On H100s with RANKS_PER_NODE of them per node (a small node makes HSDP's replicas).

Run in a process of its own: the search forks its plans, which a parent that ran autograd must not.
"""

import dataclasses
import json
import logging
import sys
import warnings

from components.config.loading import load_config
from planning import search as S
from planning.depth_scaling import state_floor
from planning.devices import DEVICES
from planning.layout_bounds import communication_floor, least_in_flight_peak, speed_bound


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    world, per_node, args = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    h100 = DEVICES["h100"]
    device = dataclasses.replace(h100, links=dataclasses.replace(h100.links, per_node=per_node))
    rows, timed = [], []
    sized_layouts = S._sized_layouts

    def sized(piece, *rest):  # noqa: ANN001, ANN002, ANN202
        out = sized_layouts(piece, *rest)
        speed = speed_bound(piece, *rest)
        tokens = piece.global_batch * piece.cfg.training.seq_len
        for s in out:
            first = s.states[piece.ranks[0]]
            timed.append(s)
            rows.append({"layout": s.layout.describe(), "bound": speed,
                         "predicted": s.layout.tokens_per_second_per_device,
                         "least_peak": s.least_peak,
                         "state": max(state_floor(state, s.replicas) for state in s.states.values()),
                         "pp": piece.dims.pp, "ac_mode": s.layout.ac_mode, "rows": s.layout.rows,
                         "planned": first.communication,
                         "floor": communication_floor(piece, tokens, s.replicas)})
        return out

    S._sized_layouts = sized
    S._check_fastest = lambda *_: None  # nothing ranked: every layout is timed
    S.search(load_config(args), world, device, top=1)
    keeps: dict = {}
    S._learn_keeps(list({id(s.piece): s.piece for s in timed}.values()), keeps)  # from the timing plans
    peaks = [(row, s) for row, s in zip(rows, timed, strict=True) if s.layout.rows == 1
             and (s.layout.ac_mode == "none" or (s.piece.dims.pp > 1 and s.layout.ac_mode == "full"))]
    jobs = {(id(s.piece), key): (s.piece, key) for _, s in peaks for key in s.needs()}
    S._plan(list(jobs.values()), 2)
    for row, s in peaks:
        row["peak"] = s.peak(1)
        row["in_flight_peak"] = least_in_flight_peak(s.piece, s.replicas, s.layout.ac_mode,
                                                     keeps[S._keeps_key(s.piece)])
        row["state_only"] = least_in_flight_peak(s.piece, s.replicas, s.layout.ac_mode, {})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
