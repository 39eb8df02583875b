"""Tools that run or score the trainer and the planner: the planner's validation against measured runs
(`validate.py`) and the calibration of a machine into a hardware profile (`calibrate/`)."""
