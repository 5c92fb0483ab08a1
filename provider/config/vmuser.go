package config

import (
	"fmt"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

// DefaultVMUID and DefaultVMGID are the user every QEMU runs as when the
// agent runs as root and the file names none: KubeVirt's qemu user (107),
// so hosts that run both give QEMU one uid.
const (
	DefaultVMUID = 107
	DefaultVMGID = 107
)

// maxID is the largest uid or gid ((uid_t)-1 means "unchanged" to the
// kernel).
const maxID = 1<<32 - 2

// VMUser is the user every QEMU runs as.
type VMUser struct {
	// UID and GID of QEMU (both or neither). Absent: 107 and 107 when the
	// agent runs as root, else the agent's own (a non-root agent cannot
	// start QEMU as anyone else). 0 runs QEMU as root (without
	// capabilities): only when written here.
	UID *int64 `json:"uid,omitempty"`
	GID *int64 `json:"gid,omitempty"`
}

// VMUserConfig is the resolved vmUser section.
type VMUserConfig struct {
	UID, GID uint32
}

func defaultVMUser(c *VMUser, env Environment) {
	if c.UID != nil || c.GID != nil {
		return
	}
	uid, gid := int64(env.AgentUID), int64(env.AgentGID)
	if env.AgentUID == 0 {
		uid, gid = DefaultVMUID, DefaultVMGID
	}
	c.UID, c.GID = &uid, &gid
}

func validateVMUser(c VMUser, env Environment, errs field.ErrorList) (VMUserConfig, field.ErrorList) {
	p := field.NewPath("vmUser")
	var out VMUserConfig
	id := func(name string, v *int64) uint32 {
		switch {
		case v == nil:
			errs = append(errs, field.Required(p.Child(name), fmt.Sprintf("set both uid and gid (or neither: %d:%d when the agent runs as root)", DefaultVMUID, DefaultVMGID)))
		case *v < 0 || *v > maxID:
			errs = append(errs, field.Invalid(p.Child(name), *v, fmt.Sprintf("must be between 0 and %d", int64(maxID))))
		default:
			return uint32(*v)
		}
		return 0
	}
	ok := len(errs)
	out.UID = id("uid", c.UID)
	out.GID = id("gid", c.GID)
	if len(errs) == ok && env.AgentUID != 0 && (out.UID != env.AgentUID || out.GID != env.AgentGID) {
		errs = append(errs, field.Invalid(p, fmt.Sprintf("%d:%d", out.UID, out.GID),
			fmt.Sprintf("the agent runs as uid %d gid %d and cannot start QEMU as another user: run the agent as root, or leave vmUser out (QEMU then runs as the agent)", env.AgentUID, env.AgentGID)))
	}
	return out, errs
}
