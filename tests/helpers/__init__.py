"""What several test modules share: independent references, small data in real formats, tiny
runs and studies. ``sweep_objective_program.py`` is also run as a program by the sweep tests."""
