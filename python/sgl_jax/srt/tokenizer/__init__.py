"""The text side of the ZMQ line: the HTTP process's TokenizerManager and ScoreClient, and the DetokenizerManager process."""
