"""Equal-budget tuning with Optuna (``simulate.py --tune N``).

Each method entry of a scenario gets its own Optuna study, kept in one SQLite storage per
scenario (``OUT/tuning/<scenario>/optuna.db``, readable by ``optuna-dashboard``), over the space
its method declares (:class:`pflalign.settings.params.Search`: log-scaled ranges for learning
rates and penalty weights, uniform ranges, or sets of values). Trial ``k`` of every method runs
in one group (one run of all the methods' ``k``-th points) on each tuning seed; its score, the
mean over the tuning seeds of the final validation metric, is told to each method's study before
trial ``k + 1`` is asked for. So every method gets the same ``N`` trials of the same rounds (no
pruning), a method without a search space runs once at its configured values, and trial 0 is the
method's configured values when they lie in its space.

Points after the first come from Optuna's TPE sampler (Bergstra et al., "Algorithms for
Hyper-Parameter Optimization", NeurIPS 2011): :func:`startup_trials` random points first, then
TPE. The sampler is made anew for each trial, seeded by (the first tuning seed, the trial's
number), so a trial's point depends only on the trials told before it: a tuning killed at any
moment and resumed asks for the same points, and the storage keeps every point asked and every
score told. A sampled value runs rounded to :data:`DIGITS` significant digits (0.0131, not
0.013124186...), which keeps labels and reports readable; Optuna models the value it drew.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pflalign.settings.options import ConfigError, Value
from pflalign.settings.params import Search

#: the storage of one scenario's tuning, in its tuning folder
STORAGE_FILE = "optuna.db"
#: the random stream of the samplers' seeds
SAMPLER_STREAM = 11
#: significant digits a sampled value runs with
DIGITS = 3


def require_optuna() -> None:
    """Refuse ``--tune`` in one sentence where Optuna is not installed."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("--tune needs Optuna: pip install -e '.[tune]' (the test extra has "
                          "it too).") from None


def startup_trials(budget: int) -> int:
    """Trials drawn at random (the first may be the configured values) before TPE models the
    scores: a quarter of the budget, at least 2; Optuna's own default, 10, would leave a budget
    of 10 or fewer all random."""
    return max(2, budget // 4)


def distributions(space: Mapping[str, Search]) -> dict[str, Any]:
    """Optuna's distributions for a declared space (Optuna is imported where it is used: the
    extra ``tune`` installs it)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    return {key: CategoricalDistribution(list(search.choices)) if search.choices
            else FloatDistribution(float(search.low), float(search.high), log=search.log)
            for key, search in space.items()}


class MethodSearch:
    """One method entry's trials in a scenario's storage: :meth:`point` asks for trial ``k``'s
    values (or reads them back when they were asked before), :meth:`tell` records its score."""

    def __init__(self, storage: Path, name: str, space: Mapping[str, Search],
                 configured: Mapping[str, Value], budget: int, seed: int,
                 maximize: bool = True):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage.parent.mkdir(parents=True, exist_ok=True)
        self.space = dict(space)
        self.distributions = distributions(space)
        self.configured = dict(configured)
        self.budget = budget if space else 1
        self.seed = seed
        self.study = optuna.create_study(
            study_name=name, storage=f"sqlite:///{storage.resolve()}", load_if_exists=True,
            direction="maximize" if maximize else "minimize")

    def _sampler(self, number: int) -> Any:
        from optuna.samplers import TPESampler

        seed = int(np.random.SeedSequence([self.seed, SAMPLER_STREAM, number]).generate_state(
            1)[0])
        return TPESampler(seed=seed, n_startup_trials=startup_trials(self.budget))

    def point(self, number: int) -> dict[str, Value]:
        """The values of trial ``number`` (trials are asked in order, each after the one before
        it was told)."""
        from optuna.trial import TrialState

        if not self.space:
            return {}
        trials = self.study.get_trials(deepcopy=False)
        if number < len(trials) and trials[number].state != TrialState.WAITING:
            return self._rounded(trials[number].params)
        if number > len(trials) or (number < len(trials) and number != len(trials) - 1):
            raise RuntimeError(f"Tuning storage out of order: trial {number} asked after "
                               f"{len(trials)} were stored.")
        if number == 0 and not trials and all(self.space[k].contains(v)
                                              for k, v in self.configured.items()):
            self.study.enqueue_trial(self.configured)
        self.study.sampler = self._sampler(number)
        trial = self.study.ask(self.distributions)
        if trial.number != number:
            raise RuntimeError(f"Tuning storage out of order: asked for trial {number}, Optuna "
                               f"gave {trial.number}.")
        return self._rounded(trial.params)

    def _rounded(self, params: Mapping[str, Value]) -> dict[str, Value]:
        """The values a trial runs with: a range's to :data:`DIGITS` significant digits (within
        the range), so that labels and reports stay readable; Optuna keeps the value it drew."""
        out: dict[str, Value] = {}
        for key, value in params.items():
            search = self.space[key]
            if not search.choices:
                value = min(max(float(f"{float(value):.{DIGITS}g}"), float(search.low)),
                            float(search.high))
            out[key] = value
        return out

    def tell(self, number: int, score: float | None) -> None:
        """Record trial ``number``'s score (None: it failed; TPE leaves it out)."""
        from optuna.trial import TrialState

        if not self.space:
            return
        trial = self.study.get_trials(deepcopy=False)[number]
        if trial.state.is_finished():
            return
        if score is None:
            self.study.tell(number, state=TrialState.FAIL)
        else:
            self.study.tell(number, float(score))
