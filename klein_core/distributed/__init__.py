"""Batch generation (Ray Data) and serving (Ray Serve) over :class:`klein_core.pipeline.engine.Engine`.

Ray is an optional extra (``pip install "klein-nodes[ray]"``) and is imported only when a job or a
server starts (:func:`klein_core.distributed.ray_support.require_ray`). Importing this package, the
row parser or the manifest needs no Ray.
"""
