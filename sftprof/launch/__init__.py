"""The launcher: ``run_qwen3_30b_a3b_sft_profile.sh`` starts ``python -m sftprof.launch run``, which plans, runs
one torchrun per trial, postprocesses each and prints the end table. One module per job:

- :mod:`~sftprof.launch.variables`: the driver's environment variables, one table (config key, parser, default,
  doc) that the launcher, ``--help``, the docs and the checks read; its config rows are declared beside their keys in
  the schema (:mod:`sftprof.config.settings`);
- :mod:`~sftprof.launch.planning`: variables and arguments -> validated trials and how they run (:func:`plan`);
- :mod:`~sftprof.launch.plan_types`: the plan's records (:class:`Trial`, :class:`RunPlan`, ...);
- :mod:`~sftprof.launch.arguments`: the ``key=value`` arguments against the variables and the keys the driver sets
  itself (for each trial, and the profiled ranks);
- :mod:`~sftprof.launch.folders`: folder names and paths, RUN_ROOT chosen and claimed, the plan written
  (:func:`write_plan`) or removed;
- :mod:`~sftprof.launch.signals`: SIGINT / SIGTERM while planning and while trials run;
- :mod:`~sftprof.launch.trials`: the trials run, one after the other (statuses, ``summary.tsv``, ``trial_times.json``,
  a trial postprocessed while the next, a memory trial, trains; the what-ifs tried);
- :mod:`~sftprof.launch.processes`: the running trial's processes (torchrun, workers left behind, the watchdog,
  postprocessing) and the console they share;
- :mod:`~sftprof.launch.what_ifs`: the what-if trials of ``TRY_WHAT_IFS`` (which, their arguments, ``what_if.json``);
- :mod:`~sftprof.launch.nodes`: multi-node end records;
- :mod:`~sftprof.launch.summaries`: what the end table reads of each ``profile_summary.json``;
- :mod:`~sftprof.launch.report`: the end table;
- :mod:`~sftprof.launch.cli`: the commands (``run``, ``plan``, ``usage``, ``report``).

This package's names below are its public surface.
"""
from sftprof.launch.arguments import TRIAL_KEYS
from sftprof.launch.folders import check_writable_folder, log_user, model_tag, write_plan
from sftprof.launch.nodes import wait_for_nodes, write_node_record
from sftprof.launch.plan_types import PlanLog, RunPlan, Trial
from sftprof.launch.planning import free_port, plan, port_in_use, read_driver_env, visible_gpus
from sftprof.launch.report import report
from sftprof.launch.summaries import top_finding
from sftprof.launch.trials import record_trials_not_run
from sftprof.launch.variables import VARIABLES, DriverError, unknown_variable_warnings, usage

__all__ = ["TRIAL_KEYS", "VARIABLES", "DriverError", "PlanLog", "RunPlan", "Trial", "check_writable_folder", "free_port",
           "log_user", "model_tag", "plan", "port_in_use", "read_driver_env", "record_trials_not_run", "report",
           "top_finding", "unknown_variable_warnings", "usage", "visible_gpus", "wait_for_nodes", "write_node_record",
           "write_plan"]
