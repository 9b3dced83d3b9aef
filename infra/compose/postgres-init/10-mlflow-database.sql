-- The postgres image creates POSTGRES_DB (prefect) on first start; MLflow gets its own database
-- on the same instance, owned by the same user.
CREATE DATABASE mlflow;
