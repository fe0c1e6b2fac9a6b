"""Studies and the plan search: many runs of one command, each a typed request shipped to a
worker and its result brought back as an object.

- `spec`: the study file (`command`, `base`, `grid`, `zip`, `metrics`, `plot`) as a `StudySpec`
- `points`: one point's request, the checks before any runs, its run and its flattened result
- `backends`: where jobs run (this process, a local pool, a Dask cluster)
- `results`: the rows, their statuses and the results frame; `resume`: reading them back
- `sweep`: running a study (`tpusim sweep`, `sim.sweep`)
- `plots`: the study and plan PNGs
- the plan (`tpusim plan`, `sim.plan`): its space of candidates (`plan_space`), what it ranks
  by (`plan_objectives`), lower bounds of a candidate (`plan_bounds`), the jobs its workers run
  (`plan_jobs`), the best-first search (`plan_search`), the ranked table (`plan_report`)

The submodules are imported by name (`from sim.studies.sweep import run_study`); this package
imports none of them, so that loading one loads only what it needs.
"""
