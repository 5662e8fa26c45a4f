"""Tuning: the Optuna search over an op's space (``search``), the fleet that spreads it over GPUs and hosts
(``fleet``, ``claims``), the studies' storage (``storage``), kernel timing (``timing``), the tables it writes
(``tables``), one run from one settings object (``driver``) and the run's reports and table listings
(``report``). Sits above ``codegen`` (what is searched) and ``runtime`` (the tables it writes); it is handed op
specs and never imports ``liger_gen.ops``."""
