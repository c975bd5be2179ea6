"""E2B volumes on a node: the store of volumes and their disks (:mod:`.store`) and the
volume content API's file operations (:mod:`.content`)."""
