package qemu

import (
	"encoding/json"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
)

// State is the VM's life-cycle state as this package sees it.
type State string

const (
	StateStarting State = "starting"
	StateRunning  State = "running"
	// StatePaused: vCPUs stopped (QMP stop, or a guest shutdown/panic the
	// supervisor is about to turn into an exit).
	StatePaused State = "paused"
	// StateExited: QEMU is gone; Exit() says why.
	StateExited State = "exited"
)

// ExitClass says why a VM ended.
type ExitClass string

const (
	// ExitGuestShutdown: the guest powered off (exit code 0).
	ExitGuestShutdown ExitClass = "guest-shutdown"
	// ExitPanicked: the guest kernel panicked (pvpanic).
	ExitPanicked ExitClass = "panicked"
	// ExitKilled: we (Stop after its deadline, Kill) or a host signal ended
	// QEMU while the guest was still running.
	ExitKilled ExitClass = "killed"
	// ExitCrashed: QEMU died on its own (signal, assertion, OOM kill,
	// internal error) or vanished while nobody supervised it.
	ExitCrashed ExitClass = "crashed"
)

// Exit codes reported for each class. The provider maps them to container
// states: 0 -> Terminated/Completed; others -> Terminated/Error, with the
// class as the reason ("GuestPanicked" for ExitPanicked).
const (
	ExitCodeGuestShutdown = 0
	ExitCodePanicked      = 134 // like SIGABRT: the guest aborted
	ExitCodeKilled        = 137 // like SIGKILL: forced stop
	ExitCodeTerminated    = 143 // like SIGTERM: QEMU got a host signal
	ExitCodeCrashed       = 139 // like SIGSEGV: QEMU itself failed
)

// Exit is how a VM ended; persisted as exit.json in the state dir.
type Exit struct {
	Class    ExitClass `json:"class"`
	ExitCode int       `json:"exitCode"`
	// Reason is human-readable detail, e.g. "guest powered off",
	// "QEMU killed by signal 9", "quit after 5s ACPI deadline".
	Reason string    `json:"reason"`
	At     time.Time `json:"at"`
}

// Event is one typed VM event. Concrete types: Shutdown, Reset,
// GuestPanicked, Stop, Resume, Powerdown, Exited.
type Event interface {
	EventTime() time.Time
}

// Stamp carries an event's time.
type Stamp struct{ At time.Time }

func (s Stamp) EventTime() time.Time { return s.At }

// Shutdown: QEMU's SHUTDOWN. Guest is true when the guest caused it;
// Reason is QEMU's ShutdownCause ("guest-shutdown", "guest-panic",
// "host-qmp-quit", "host-signal", ...).
type Shutdown struct {
	Stamp
	Guest  bool
	Reason string
}

// Reset: the VM was reset (guest reboot or host request).
type Reset struct {
	Stamp
	Guest  bool
	Reason string
}

// GuestPanicked: pvpanic reported a guest panic; Action is QEMU's.
type GuestPanicked struct {
	Stamp
	Action string
}

// Stop: vCPUs stopped.
type Stop struct{ Stamp }

// Resume: vCPUs resumed.
type Resume struct{ Stamp }

// Powerdown: an ACPI power-button press was delivered.
type Powerdown struct{ Stamp }

// Exited: QEMU is gone. Always the last event.
type Exited struct {
	Stamp
	Exit
}

// fromQMP converts a QMP event; ok is false for events we do not type.
func fromQMP(e qmp.Event) (Event, bool) {
	at := time.Unix(e.Timestamp.Seconds, e.Timestamp.Microseconds*1000)
	if e.Timestamp.Seconds <= 0 {
		at = time.Now()
	}
	st := Stamp{At: at}
	str := func(k string) string { s, _ := e.Data[k].(string); return s }
	b := func(k string) bool { v, _ := e.Data[k].(bool); return v }
	switch e.Event {
	case "SHUTDOWN":
		return Shutdown{Stamp: st, Guest: b("guest"), Reason: str("reason")}, true
	case "RESET":
		return Reset{Stamp: st, Guest: b("guest"), Reason: str("reason")}, true
	case "GUEST_PANICKED":
		return GuestPanicked{Stamp: st, Action: str("action")}, true
	case "STOP":
		return Stop{Stamp: st}, true
	case "RESUME":
		return Resume{Stamp: st}, true
	case "POWERDOWN":
		return Powerdown{Stamp: st}, true
	}
	return nil, false
}

// cause accumulates what we learned before QEMU went away; classify turns it
// into an Exit. Pure.
type cause struct {
	GuestShutdown bool   // SHUTDOWN guest=true, reason guest-shutdown
	Panicked      bool   // GUEST_PANICKED or reason guest-panic
	InternalError bool   // run state internal-error
	HostSignal    bool   // SHUTDOWN reason host-signal (someone signalled QEMU)
	ForcedBy      string // set when we quit/killed it: why
	ProcessStatus string // wait status when QEMU was our child, e.g. "signal: killed"
	Unsupervised  bool   // found dead at adopt without a record
}

func classify(c cause, at time.Time) Exit {
	at = at.Round(0) // no monotonic reading: the record round-trips through JSON
	switch {
	case c.Panicked:
		return Exit{Class: ExitPanicked, ExitCode: ExitCodePanicked, Reason: "guest kernel panicked (pvpanic)", At: at}
	case c.GuestShutdown:
		return Exit{Class: ExitGuestShutdown, ExitCode: ExitCodeGuestShutdown, Reason: "guest powered off", At: at}
	case c.InternalError:
		return Exit{Class: ExitCrashed, ExitCode: ExitCodeCrashed, Reason: "QEMU reported an internal error (emulation failure)", At: at}
	case c.ForcedBy != "":
		return Exit{Class: ExitKilled, ExitCode: ExitCodeKilled, Reason: c.ForcedBy, At: at}
	case c.HostSignal:
		return Exit{Class: ExitKilled, ExitCode: ExitCodeTerminated, Reason: "QEMU terminated by a host signal", At: at}
	case c.Unsupervised:
		return Exit{Class: ExitCrashed, ExitCode: ExitCodeCrashed, Reason: "QEMU exited while unsupervised; no exit was recorded", At: at}
	default:
		r := "QEMU exited unexpectedly"
		if c.ProcessStatus != "" {
			r += " (" + c.ProcessStatus + ")"
		}
		return Exit{Class: ExitCrashed, ExitCode: ExitCodeCrashed, Reason: r, At: at}
	}
}

func (e Exit) marshal() []byte {
	b, _ := json.MarshalIndent(e, "", "  ")
	return append(b, '\n')
}
