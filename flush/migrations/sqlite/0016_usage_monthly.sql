-- 0016_usage_monthly: the settled usage of each account by month and route,
-- kept up to date from usage_daily by triggers (whatever writes usage_daily),
-- so that the config snapshot every node reads every few seconds can carry
-- the month's split by route for each account (a node that takes an account
-- over shows the whole month's routes in the usage endpoint, not only its
-- own charges) at the cost of one row per account and route, not one per
-- key, route and day. A month is the day's UTC month, as Usage and
-- BillingUsage read usage_daily.
CREATE TABLE usage_monthly (
    account_id TEXT    NOT NULL,
    period     TEXT    NOT NULL,  -- "2026-06"
    route      TEXT    NOT NULL,
    units      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (period, account_id, route)
);

INSERT INTO usage_monthly (account_id, period, route, units)
SELECT account_id, substr(day, 1, 7), route, sum(units)
FROM usage_daily WHERE true GROUP BY 1, 2, 3;

CREATE TRIGGER usage_monthly_ins AFTER INSERT ON usage_daily BEGIN
    INSERT INTO usage_monthly (account_id, period, route, units)
    VALUES (NEW.account_id, substr(NEW.day, 1, 7), NEW.route, NEW.units)
    ON CONFLICT (period, account_id, route) DO UPDATE SET units = units + excluded.units;
END;

CREATE TRIGGER usage_monthly_upd AFTER UPDATE ON usage_daily BEGIN
    UPDATE usage_monthly SET units = units - OLD.units
    WHERE period = substr(OLD.day, 1, 7) AND account_id = OLD.account_id AND route = OLD.route;
    INSERT INTO usage_monthly (account_id, period, route, units)
    VALUES (NEW.account_id, substr(NEW.day, 1, 7), NEW.route, NEW.units)
    ON CONFLICT (period, account_id, route) DO UPDATE SET units = units + excluded.units;
END;

CREATE TRIGGER usage_monthly_del AFTER DELETE ON usage_daily BEGIN
    UPDATE usage_monthly SET units = units - OLD.units
    WHERE period = substr(OLD.day, 1, 7) AND account_id = OLD.account_id AND route = OLD.route;
END;
