"""Studies over frozen models, run as python -m studies.NAME: latent tokens on a frozen base
(latent_experiments) and ReFlux on a frozen Transformer++ (reflux_cli)."""
