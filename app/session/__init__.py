"""The session core every transport stands on: the policy and its gate (policy), a conversation's stream and
turns (conversation), one utterance checked once (utterance), the event pump (pump), an HTTP reply's life
(http) and a WebSocket session's life (wire). Transports only parse requests and render events."""
