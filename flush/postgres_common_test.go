package flush

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/quotaring/quotaring/internal/pgtest"
)

// A connect error keeps the server's SQLSTATE under the scrubbed text, so
// that WhatToCheck's advice for a wrong password or a missing database is
// reached: OpenPostgres formatted it with %s, and every refusal got the
// generic "address, reachability, credentials".
func TestWhatToCheckSeesTheConnectErrorsCode(t *testing.T) {
	for code, want := range map[string]string{
		"28P01": "the credentials in --ledger",
		"3D000": "the server has no such database",
		"53300": "connections are used up",
		"57P03": "starting up or in recovery",
	} {
		pgErr := &pgconn.PgError{Code: code, Message: "password authentication failed for user \"q\" (secret-pw)"}
		err := fmt.Errorf("%w: cannot connect to Postgres at h: %w: check ...", ErrUnavailable,
			scrubbedError{scrubPassword(pgErr.Error(), "postgres://q:secret-pw@h/db"), pgErr})
		if got := WhatToCheck(err); !strings.Contains(got, want) {
			t.Errorf("%s: WhatToCheck = %q, want it to say %q", code, got, want)
		}
		if strings.Contains(err.Error(), "secret-pw") || !errors.Is(err, ErrUnavailable) {
			t.Errorf("%s: %v: the password shows, or ErrUnavailable is lost", code, err)
		}
	}
}

// Against a real server: a DSN naming a database it does not have gets the
// advice for that, through OpenPostgres.
func TestOpenPostgresMissingDatabaseAdvice(t *testing.T) {
	dsn := pgtest.NewDB(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/no_such_database"
	_, err = OpenPostgres(context.Background(), u.String(), PGOptions{})
	if err == nil || !strings.Contains(WhatToCheck(err), "the server has no such database") {
		t.Fatalf("OpenPostgres of a missing database: %v; WhatToCheck %q, want the database named", err, WhatToCheck(err))
	}
}
