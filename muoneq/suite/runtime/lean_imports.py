"""Import Lightning without the optional packages torchmetrics loads for metrics a run never builds.

Lightning imports torchmetrics (for its ``Metric`` class), and torchmetrics 1.x imports, when
they are installed, torchvision (for its image and detection metrics), transformers (BERTScore,
InfoLM, CLIPScore), ``scipy.signal`` and matplotlib (plots) as soon as it is imported, whether or
not one of those metrics is ever built: a large share of a run process's imports
(``python -X importtime``; ``make bench-trial`` times a trial's imports). Neither library offers
a switch, so :func:`import_lightning` gives torchmetrics the answer it would get without them:
while Lightning (and with it torchmetrics) is imported, ``lightning_utilities``' availability
checks, through which both libraries ask, say that these packages are not installed.

The answers are cached by torchmetrics for the life of the process: in it, torchmetrics' metrics
that need one of these packages say that it is missing. So only a task that declares it uses none
of them through torchmetrics (:attr:`muoneq.suite.runtime.tasks.TaskSpec.lean_imports`) is run
this way. Nothing else changes: the packages stay importable (a language run of a Hugging Face
model imports transformers itself; a vision run may download CIFAR-10 with torchvision), and
checks made after Lightning's import get the true answer.

It serves every process that imports the runtime: ``muoneq train`` typed by hand or spawned
by a sweep (:func:`muoneq.suite.runtime.cli.load_train`), and a sweep's warm server
(:func:`muoneq.suite.sweeps.warm.preload`), whose import every study waits for once (1,193 of
its 4,097 modules, 4–6 s of its 10–17 s on the project's 2-core machine under load: a
six-trial study's trials ≈ 0.8 s each), and whose trials then see the metrics a spawned trial
sees. The hooks are private to ``lightning_utilities``: ``tests/test_trial_cost.py`` fails when
they change.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: What torchmetrics imports when installed and a run of a lean task never uses through it.
OPTIONAL = frozenset({"torchvision", "transformers", "scipy", "matplotlib"})


def _top_name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(requirement).name.replace("-", "_").lower()


@contextmanager
def hidden(packages: frozenset[str] = OPTIONAL) -> Iterator[None]:
    """While inside, ``lightning_utilities``' ``RequirementCache`` and ``package_available`` say
    that ``packages`` are not installed (see the module docstring); a ``lightning_utilities``
    without these two hooks is left as it is (the run then imports everything, only slower)."""
    from lightning_utilities.core import imports

    check = getattr(imports.RequirementCache, "_check_requirement", None)
    available = getattr(imports, "package_available", None)
    if check is None or available is None:  # another lightning_utilities: import it all, as is
        yield
        return
    inside = [True]  # a module that imported package_available meanwhile keeps this function

    def check_requirement(self) -> None:
        if _top_name(self.requirement) in packages:
            self.available, self.message = False, f"{self.requirement!r} not imported by muoneq"
            return
        check(self)

    def package_available(name: str) -> bool:
        return not (inside[0] and name.partition(".")[0] in packages) and available(name)

    imports.RequirementCache._check_requirement = check_requirement
    imports.package_available = package_available
    try:
        yield
    finally:
        inside[0] = False
        imports.RequirementCache._check_requirement = check
        imports.package_available = available


def import_lightning(lean: bool) -> None:
    """Import Lightning (and torchmetrics) for a run; ``lean``: without :data:`OPTIONAL`.
    Without effect once Lightning is imported."""
    if not lean or "lightning" in sys.modules or "torchmetrics" in sys.modules:
        import lightning.pytorch  # noqa: F401
        return
    with hidden():
        import lightning.pytorch  # noqa: F401
        import torchmetrics  # noqa: F401
