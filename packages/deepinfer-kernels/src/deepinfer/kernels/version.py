__version__ = "0.1.0"

# Backends built against a different op API version are refused at discovery.
API_VERSION = 1
