"""``kitsune bench``: torch's AdamW variants against kitsune's on the same params, in one process; with
``--peers``, also the optimizers users pick instead (bitsandbytes, torchao, optimi, heavyball, lion-pytorch, a
compiled torch step) where they are installed.

>>> from kitsune.bench import run_bench
>>> result = run_bench(sets=["gpt2"], device="cpu", steps=3)  # doctest: +SKIP
"""

from kitsune.bench.cli import add_arguments, main, register, run_from_args
from kitsune.bench.params import PARAM_SETS, ParamSet, get_param_set, make_params
from kitsune.bench.peers import LION, PEERS, Peer
from kitsune.bench.results import BenchResult, KitsuneInfo, PeerInfo, PeerStatus, SetResult, VariantResult
from kitsune.bench.runner import (
    ADAMW_BYTES_PER_PARAM,
    LION_BYTES_PER_PARAM,
    PHASE_BYTES_PER_PARAM,
    run_bench,
    run_peer,
    run_phase,
    run_variant,
)
from kitsune.bench.table import print_results
from kitsune.bench.timing import Stats, copy_bandwidth, time_steps
from kitsune.bench.variants import ADAMW, VARIANTS, make_variant

__all__ = [
    "ADAMW",
    "ADAMW_BYTES_PER_PARAM",
    "LION",
    "LION_BYTES_PER_PARAM",
    "PARAM_SETS",
    "PEERS",
    "PHASE_BYTES_PER_PARAM",
    "VARIANTS",
    "BenchResult",
    "KitsuneInfo",
    "ParamSet",
    "Peer",
    "PeerInfo",
    "PeerStatus",
    "SetResult",
    "Stats",
    "VariantResult",
    "add_arguments",
    "copy_bandwidth",
    "get_param_set",
    "main",
    "make_params",
    "make_variant",
    "print_results",
    "register",
    "run_bench",
    "run_from_args",
    "run_peer",
    "run_phase",
    "run_variant",
    "time_steps",
]
