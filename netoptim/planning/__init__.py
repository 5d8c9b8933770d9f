"""Planning: what a job costs and how to lay it out, from measured costs and simulation. Shared by the
pipeline runtime, the pipeline planner (`netoptim plan`) and the benchmarks; it imports no worker or
node code, so both sides and the tools can use it."""
