"""What users run today instead of this service: the conventional SDK ``FastAPIServer`` ETL."""
