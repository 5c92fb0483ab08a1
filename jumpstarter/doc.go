// Package jumpstarter speaks Jumpstarter's gRPC protocol (package
// jumpstarter.v1) as an exporter: it registers one target with a Jumpstarter
// controller, keeps its Status stream open so the Exporter is Online, listens
// for leases, and for every client connection the router hands it, serves
// ExporterService (driver report and calls) and RouterService.Stream (byte
// streams) through that router stream.
//
// It knows nothing of Kubernetes or QEMU: the node agent hands it a Target
// (one VM) and the connection settings a pod named. See target.go for the
// contract and docs/jumpstarter.md for what users see.
package jumpstarter
