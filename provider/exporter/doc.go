// Package exporter is the built-in Jumpstarter exporter of a VM pod: a
// pod that names a Secret in the annotation
// v1alpha1.JumpstarterSecretAnnotation is served as an exporter by the
// node agent itself (no sidecar, no agent in the guest). It owns:
//   - the exporter's settings, read from the pod's Secret (Settings,
//     CheckConfig: a pod that asked to be an exporter never runs as
//     something else);
//   - one pod's exporter supervisor (Supervisor): it runs the exporter
//     through Node.Runner from the pod's first Ready to its deletion,
//     restarts it when the Secret changes or it gives up, and shows its
//     state as the pod condition Condition and events;
//   - the VM as the exporter's jumpstarter.Target (target.go): power and
//     flash as requests to the pod's worker, the serial console, guest TCP
//     ports, VNC, resize (vmsize.go), partitions (flash.go);
//   - what a flash leaves in the pod's state dir and state (install.go:
//     Flash.Place, Flash.Record) and what a flashed pod boots (FlashedRoot,
//     ApplyFlashedFirmware), which the pod's worker applies.
//
// It reaches its pod through Pod, which package provider implements over
// the pod's record and worker; it knows nothing of package provider
// (build/deps_test.go). The worker alone starts, stops and re-images the
// VM: every power and flash request is answered by it.
package exporter
