"""`kubectl knit explain`: the path of a new connection and the rules that decide it, computed
from the API objects by the daemon's own model, topology and policy compiler."""
