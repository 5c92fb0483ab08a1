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
//
// Layout:
//   - proto/jumpstarter/v1: copies of upstream's .proto files
//     (jumpstarter-dev/jumpstarter b1f2bb41, unchanged); pb: their Go code
//     (hack/gen-proto.sh, checked by make verify).
//   - exporter.go: New and Run. The Run goroutine owns the State, the
//     controller session (Register, Status, ReportStatus, Unregister) and
//     the current lease; onStatus decides what a StatusResponse means.
//     Each lease has a Listen goroutine; each router token becomes one
//     router stream wrapped as a net.Conn (internal/streamconn) and handed
//     to the exporter's local gRPC server, which serves it like any
//     connection. A lease's end closes its connections, used or not. The
//     lease outlives controller sessions (a controller restart only
//     restarts Listen on the new connection, as upstream's exporter does),
//     so open client streams survive it; classify and retryDelay decide
//     how soon to reconnect from the controller's error.
//   - drivers.go, server.go: the driver tree upstream's QEMU driver reports
//     (root QemuClient; power, flasher, console as PySerialClient, one
//     NetworkClient per Config.Ports entry) and the calls and byte streams
//     it answers; serial.go the console's PySerial calls; help.go each
//     driver's description and methods_description (the `j` help);
//     report.go the labels Register and GetReport carry.
//   - resource.go, flasher.go: resources (files a client flashes or
//     dumps: client_stream handles over RouterService.Stream, presigned
//     HTTP requests), their decoding by signature, and the flasher's
//     flash/dump onto a DiskTarget's partitions.
//   - jstest: an in-memory controller and router with upstream's semantics
//     and a Go client doing what jmp/j do, for tests here and end to end.
package jumpstarter
