"""Sweeps of the pipeline over models x variants x targets on Ray (issue 23).

Modules, one concern each:

- :mod:`deploykit.sweep.spec`: the sweep spec (command line or TOML), its targets and budget.
- :mod:`deploykit.sweep.plan`: the stage commands of one (model, target) pipeline.
- :mod:`deploykit.sweep.stamp`: the up-to-date rule (provenance stamp of a pipeline).
- :mod:`deploykit.sweep.resources`: targets -> Ray resources, availability on the cluster.
- :mod:`deploykit.sweep.task`: what a Ray task runs (the pipeline's commands, its rows).
- :mod:`deploykit.sweep.driver`: Ray start/connect, submission, per-task failure isolation.
- :mod:`deploykit.sweep.report`: the cross-model table, verdicts and Pareto plots.

Only :mod:`deploykit.sweep.driver` imports ray (lazily); everything else is stdlib (+ numpy and
matplotlib for the plot), so specs, stamps and reports work without Ray installed.
"""
