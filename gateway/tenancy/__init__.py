"""Tenancy: whose a request is and what its tenant may use.

API keys (api_keys.py) name a request's tenant (tenants.py, the tenants
file); admission (admission.py) lets a tenant's request in within its
allowance and the limits every gateway holds together (quotas.py); every
request ends with one usage record, for billing (usage.py).

It may use the gateway's top level (errors, settings) and dispatch's
in-flight requests (a usage record is made of one), never the routes or
the service: the service asks it, not the other way round.
"""
