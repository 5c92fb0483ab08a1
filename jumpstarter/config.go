package jumpstarter

import (
	"time"

	"github.com/go-logr/logr"
)

// Config is what one exporter needs. The node agent fills it from the
// Secret a pod names (see api/v1alpha1's JumpstarterSecret* keys) and the VM.
type Config struct {
	// Endpoint is the controller's gRPC address (host:port, TLS).
	Endpoint string
	// Token is the exporter's bearer token (Exporter status.credential).
	// Never logged.
	Token string
	// Namespace and Name identify the Exporter object.
	Namespace, Name string
	// CABundle verifies the controller's and the router's certificates
	// (PEM); empty: the system roots.
	CABundle []byte
	// Insecure dials the controller and router without TLS (tests only).
	Insecure bool

	// Labels are sent with Register (the controller keeps only
	// jumpstarter.dev/ ones; lease selectors match the Exporter object).
	Labels map[string]string
	// Target is the VM; Ports the guest TCP ports reported as network
	// drivers (besides the console and power drivers every target has).
	Target Target
	Ports  []Port
	// Resources bound the files clients flash and dump (resource.go).
	Resources ResourceOptions
	// Display reports a vnc child streaming the target's display; the
	// Target must then be a Displayer.
	Display bool
	// Logs is the target's LogBook, streamed by LogStream; the exporter
	// adds its own lines. nil: the exporter makes one of its own.
	Logs *LogBook
	// Hostname, Username, Password answer the root driver's get_hostname,
	// get_username and get_password (upstream QemuClient): the guest's
	// login, which QemuClient.shell() uses over the ssh child. Password is
	// never logged.
	Hostname, Username, Password string

	// Hooks are what the exporter does around each lease (hooks.go): the
	// reset at a lease's end and the beforeLease and afterLease hooks.
	Hooks LeaseHooks
	// ExitOnLeaseEnd ends the exporter when its first lease ends (after
	// the afterLease hook), as upstream's exporter does with
	// exitOnLeaseEnd: it never reports AVAILABLE again, unregisters, and
	// Run returns an error wrapping ErrExitOnLeaseEnd.
	ExitOnLeaseEnd bool

	// OnState is called (from the exporter's own goroutine, never
	// concurrently) on every state change; err is set for StateFailed.
	OnState func(s State, err error)
	// Observer receives metrics (optional).
	Observer Observer
	// Log is the exporter's logger (tokens are never logged).
	Log logr.Logger
	// Backoff bounds reconnect delays (defaults 1s doubling to 30s) after
	// the controller refused the token or the Exporter; temporary failures
	// (controller unreachable, restarting, still starting) are retried at
	// most 2 s apart.
	BackoffInitial, BackoffMax time.Duration
}

// Observer receives what the exporter does, for Prometheus metrics. The
// node agent implements it; nil means no metrics. Its methods are called
// concurrently (from the exporter's goroutine and from every client
// connection's).
type Observer interface {
	// Registration is called after every Register attempt (err nil on success).
	Registration(err error)
	// DriverCall is called after every DriverCall/StreamingDriverCall with
	// the driver's name (jumpstarter.dev/name, "" for the root), the
	// method and the gRPC status code name ("OK", "NotFound"...).
	DriverCall(driver, method, code string)
	// StreamOpened/StreamClosed bracket every byte stream; kind is
	// "console", "tcp", "vnc" or "resource" (a file flashed or dumped).
	StreamOpened(kind string)
	StreamClosed(kind string)
}
