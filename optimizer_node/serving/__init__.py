"""What a node sends: every outgoing message, new parameter values (PULL answered, batched PARAMS,
the same-host board), STATUS replies, echoes, and the budget for answers to peers outside the job."""
