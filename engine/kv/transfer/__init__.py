"""Moving KV cache blocks between two instances' kv_transfer actors, for prefill/decode
disaggregation: a numpy view of a rank's cache segment, the hold table, the TCP wire protocol,
and both ends of a pull. Plain Python, testable without processes; the actor
(engine.actors.kv_transfer) is its shell."""
