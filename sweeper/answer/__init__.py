"""What a person reads of a sweep: the results table and its best trial (`table`), the notes
(`notes`), the HTML report (`report`), the terminal (`console`, `progress`), a trial exported
as MaxText's command, its environment or a trial configuration (`export`), the MLflow UI
(`ui`)."""
