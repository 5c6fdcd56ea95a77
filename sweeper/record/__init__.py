"""What a sweep keeps: a trial as a typed row of the results table (`row`), the tracking store,
MLflow or memory (`stores`), what a sweep records and when (`tracker`, fed by Tune's events
through `callback`), writes kept through a store's outage (`journal`), the sweep's folder and
manifest (`manifest`), and how the MLflow UI lays it out (`mlflow_view`)."""
