"""Moving a rank's training state between worker processes: the state's codec
(`codec`: JSON skeleton plus tensor bytes), the replay from replicas to a spare
(`state_transport`), host memory a spare touched ahead of time (`landing_pool`) and
its page prefault (`page_prefault`).
"""
