package jumpstarter

import (
	"context"
	"io"
	"net"
)

// Target is the device one exporter serves: one VM owned by the node agent.
// Every method may be called concurrently from several client connections;
// the implementation serialises what must be serialised (power, flash).
type Target interface {
	// PowerOn starts the target; a running target is left as it is.
	PowerOn(ctx context.Context) error
	// PowerOff stops the target at once, as upstream's QEMU driver does
	// (QEMU is terminated, and killed if it has not quit within 5 s): the
	// guest is not shut down. A stopped target is left as it is.
	PowerOff(ctx context.Context) error
	// Powered reports whether the target is running.
	Powered() bool
	// Console opens the serial console: reads return guest output from now
	// on, writes go to the guest. Several consoles may be open at once, and
	// each reads and writes as on a pty (writes interleave, every reader
	// sees the output). A Write the target refuses (another party holds the
	// console) fails with an error saying why; the client's stream then ends
	// with that error. Close detaches.
	Console(ctx context.Context) (io.ReadWriteCloser, error)
	// DialGuest opens a TCP connection to a port of the guest. A port the
	// guest does not listen on fails with a clear error.
	DialGuest(ctx context.Context, port int) (net.Conn, error)
	// Flash replaces the target's OS disk with the image ref (an OCI
	// reference, without any "oci://" prefix): the image is pulled and
	// verified first, then the target is powered off, its disk replaced by
	// a fresh overlay of the new image and powered on again if it was on.
	// progress receives human-readable lines as the flash goes. A bad
	// reference or a hostile image fails before the target is touched.
	Flash(ctx context.Context, ref string, progress func(line string)) error
}

// Shutdowner is a Target that can also power off gracefully: the power
// driver's `shutdown` call (upstream's PowerClient has no graceful off, so
// scripts reach it as power.call("shutdown")). Without it the call is
// Unimplemented.
type Shutdowner interface {
	// Shutdown asks the guest to power off (the ACPI power button) and
	// waits for it within the target's grace period, then stops the target
	// as PowerOff does; a stopped target is left as it is.
	Shutdown(ctx context.Context) error
}

// Port is a guest TCP port exposed as a network driver child (e.g. "ssh"
// on 22). The name is the driver's jumpstarter.dev/name.
type Port struct {
	Name string
	Port int
}

// State is what the exporter is doing, reported to the owner through
// Config.OnState (pod conditions, events, metrics).
type State string

const (
	// StateConnecting: dialling the controller (first time or after a loss).
	StateConnecting State = "Connecting"
	// StateRegistered: Register succeeded; the Status stream is not open yet.
	StateRegistered State = "Registered"
	// StateOnline: registered with the Status stream open and Available.
	StateOnline State = "Online"
	// StateLeased: a lease is active on this exporter.
	StateLeased State = "Leased"
	// StateFailed: the last attempt failed (the error says why, e.g. an
	// Unauthenticated token); the exporter retries with backoff.
	StateFailed State = "Failed"
	// StateStopped: Run returned (after Unregister when it could).
	StateStopped State = "Stopped"
)
