"""How a sweep chooses its points: the space as Optuna distributions (`distributions`), the
Tune searcher on Optuna's ask/tell (`searcher`) and what each ending tells it (`outcomes`);
every point judged by the analytic estimate (`screen`), the ladder that spends compiles on
the best of them (`ladder`), and `sweeper plan`'s space and compile (`plan`)."""
