"""``omni report``: summary, plots, HTML and Prometheus textfile from the files a run leaves behind."""
