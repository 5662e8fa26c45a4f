"""Tuning: the Optuna search over an op's space (``tuner``), kernel timing (``timing``) and the run's reports and
table listings (``report``). Sits above ``codegen`` (what is searched) and ``runtime`` (the tables it writes);
it is handed op specs and never imports ``liger_gen.ops``."""
