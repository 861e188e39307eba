"""Running: the flows (arrival sweeps, round grids, stress protocols, nightly runs), their Prefect tasks, what runs on a Ray worker, the pipeline steps, stop signals and the deployments."""
