"""What the three services share: errors, QoS, transport, servers, config."""
