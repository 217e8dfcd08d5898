"""The pipeline's stages: profile -> train predictors -> plan (placement) -> convert, and sparsify before them."""
