// Package oci owns OS images stored as OCI artifacts: it resolves a reference,
// pulls and verifies the content with the containerd libraries, unpacks it
// defensively into a content-addressed cache shared by all VMs on the host,
// and hands out local files with roles (kernel, initrd, disk).
//
// It knows nothing about Kubernetes or QEMU.
//
// # API
//
//	s, err := oci.Open(root, oci.Options{Registries: ..., Limits: ...}) // one process per root
//	img, err := s.Pull(ctx, "registry:5000/os/fedora:40", oci.PullOptions{
//		Auth:     [][]byte{secretDockerConfigJSON}, // kubernetes.io/dockerconfigjson values
//		Policy:   oci.PullIfNotPresent,             // | PullAlways | PullNever
//		Progress: func(p oci.Progress) {...},       // bytes done/total
//	})
//	release, err := s.Acquire(img.Digest) // while a VM uses img.Disk / Kernel / Initrd
//	defer release()
//	s.List()                                       // digests, names, sizes: node.status.images
//	s.GC(ctx, oci.GCPolicy{MaxBytes: ..., MaxAge: ...}) // never removes acquired images
//
// Image has local, read-only paths (Kernel, Initrd, Disk), DiskFormat (qcow2 or
// raw) and the artifact's kernel Cmdline. Use the disk as a qcow2 backing file;
// never write to it.
//
// # Formats
//
// A containerDisk (KubeVirt) is an image whose tar layers hold exactly one
// regular file under disk/. An OS image file artifact (as pushed by oras) has
// layers that are files, recognised by the project media types
// (application/vnd.qemu-kubelet.{kernel,initrd,disk,cmdline}.v1, optionally
// +xz/+zstd/+gzip) or by their org.opencontainers.image.title. Compressed
// disks are decompressed once into the cache. Indexes are resolved to the
// host platform (containerd/platforms). Anything else fails with
// ErrUnsupportedArtifact naming the media types. See docs/images.md.
//
// # Pulling
//
// Pull uses core/remotes/docker (resolver and fetcher, with a Hosts function
// built from Options.Registries: plain HTTP for loopback or configured
// registries, mirrors tried first, timeouts) and the plugins/content/local
// store: every blob is verified against its digest on commit, and an
// interrupted download stays in the store's ingest area and resumes from its
// offset with a Range request, in the same pull or in a later one, even
// after a restart. Concurrent pulls of one digest share a single download.
// Errors are *PullError values wrapping one of ErrNotFound, ErrUnauthorized,
// ErrRegistryUnavailable, ErrUnsupportedArtifact, ErrHostileContent,
// ErrTooLarge, ErrDigestMismatch or ErrInvalidReference.
//
// # Defences
//
// Tar entries with absolute paths, "..", links escaping the layer, device
// nodes, or a disk/ entry that is not a regular file are rejected; qcow2
// disks naming a backing or external data file are rejected; sizes are
// bounded per manifest, blob and unpacked file (Limits); a registry sending
// more bytes than a descriptor declares, or bytes not matching its digest,
// fails the pull and leaves nothing cached.
//
// # Cache layout
//
// See Store. Entries appear by atomic rename only when complete; Open removes
// leftovers of interrupted pulls. Layer blobs are staging only: entries hold
// hard links to them (uncompressed files, no copy) or unpacked copies, and
// the blobs are dropped once the entry is committed.
package oci
