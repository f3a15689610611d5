"""Starting a stage's process group (torchrun, accelerate launch) with the shipped accelerate configs."""
